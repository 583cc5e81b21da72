#!/usr/bin/env bash
# Session 14, first device run.
#   s14a_pytest.txt              test_backward's thread-count bits and the one-thread bf16 dQ-sum memory test, amx
#   s14a_backward_bf16_t1.txt    bench_backward.py --memory, bf16, one thread: the two d <= 64 shapes of issue 12
#                                (one dQ sum shared by the key runs on one thread; (1,12,1024,64) was 8.4 MiB vs 7.7)
#   s14a_masked_decode_*.txt     probe_masked_decode.py: a static-cache decode call alone, with its mask and without
#   s14a_profile_generate_*.txt  profile_models.py --generate: Llama's greedy generate, 16 threads, bf16, per cache
#   s14a_models_llama_t16.txt    bench_models.py: Llama, bf16, 16 threads, 7 rounds (static cache was 0.94 in s13c)
source benchmarks/device/preamble.sh
timeout 150 python3 -m pytest -q tests/test_backward.py -k "one_dq_sum or thread_count" > "$OUT/s14a_pytest.txt" 2>&1
tail -2 "$OUT/s14a_pytest.txt"
timeout 120 python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 --threads 1 --causal both \
  --dtype bfloat16 --min-run-time 0.1 --rounds 2 --memory > "$OUT/s14a_backward_bf16_t1.txt" 2>&1
grep -E "peak|^\| .* \| (bwd|fwd\+bwd) \| " "$OUT/s14a_backward_bf16_t1.txt" | cut -c1-130
for dt in bfloat16 float32; do
  timeout 60 python3 benchmarks/probe_masked_decode.py --threads 1,16 --dtype $dt > "$OUT/s14a_masked_decode_$dt.txt" 2>&1
  grep "^|" "$OUT/s14a_masked_decode_$dt.txt" | tail -4
done
for cache in dynamic static; do
  timeout 150 python3 benchmarks/profile_models.py --generate $cache --threads 16 --rows 14 \
    > "$OUT/s14a_profile_generate_$cache.txt" 2>&1
  grep -E "^## |flash_attention|flash_decode|scaled_dot|aten::mm " "$OUT/s14a_profile_generate_$cache.txt" | cut -c1-140
done
uptime
timeout 200 python3 benchmarks/bench_models.py --models llama --threads 16 --dtype bfloat16 --repeats 7 \
  > "$OUT/s14a_models_llama_t16.txt" 2>&1
grep "^|" "$OUT/s14a_models_llama_t16.txt"
uptime
