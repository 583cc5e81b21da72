#!/usr/bin/env python3
"""Decoding speed: one new query against a KV cache, ours vs torch SDPA (enable_gqa=True), in the same run.

Llama-3-8B-shaped heads by default (Hq = 32 query heads, Hkv = 8 kv heads, d = 128), batch 1 and 8, 1024–8192 cached
keys, float32 and bfloat16, 1 thread and all of them. For each shape:

    SDPA      torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  (q: B, Hq, 1, d)
    ours      cs149gpt.attention(q, k, v)   (the flash op; 1 query row goes to flash_decode.cpp)
    kvcache   cs149gpt.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens)  (the same kernel, a cache of
              room for more keys, lengths per sequence)

Medians of interleaved repetitions (µs per call). "GB/s" counts the bytes of K and V the call must read
(2 · B · Hkv · N · d · element size). The read-bandwidth probe (cs149gpt's read_probe: a float32 buffer of the same
number of bytes summed with vector loads, 8 independent chains, on the same threads, in the same rounds) says what
reading those bytes costs at best at that moment, from wherever they live (caches for the small shapes, memory for
the large ones); "% bw" is the probe's time over ours. --mask bool|additive gives ours and SDPA the same key-padding
mask, as a padded batch's generation passes it ((B, 1, 1, N): sequence i's first i·N/(2B) keys are padding; bool,
or additive −inf in the input's dtype); kvcache runs unmasked beside them. The header gives the probe's figure for 1 GiB (memory).
Also the per-call time at 128 keys (overhead-bound). --extra-isa times our kernel under a second instruction set in
the same rounds, for bf16 and fp16 (float32 runs the same code under every AVX-512 ISA); e.g. avx512_bf16 beside
amx: bf16 keys through vdpbf16ps instead of FMAs on converted keys (decode_micro.h, kKeysByBf16Dot).

    python benchmarks/bench_decode.py                      # threads 1,all; the full grid
    python benchmarks/bench_decode.py --threads 16 --keys 4096 --batches 1 --dtypes bfloat16
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import cs149gpt  # noqa: E402
from cs149gpt import _ext  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_bandwidth_gbs(threads: int, mib: int = 1024, repeats: int = 7) -> float:
    """GB/s of the read probe over a float32 buffer of `mib` MiB (far beyond the caches), median of repeats."""
    probe = _ext.load().read_probe
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    probe(x, threads)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        probe(x, threads)
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9


def time_calls(fns: dict, min_seconds: float, max_calls: int = 2000) -> dict:
    """µs per call of each function: rounds that alternate the order, each round as many calls as fit in about
    min_seconds / 5, median over rounds."""
    for fn in fns.values():
        fn()
        fn()
    start = time.perf_counter()
    next(iter(fns.values()))()
    once = max(time.perf_counter() - start, 1e-7)
    calls = int(max(1, min(max_calls, min_seconds / 5 / once)))
    results = {name: [] for name in fns}
    order = list(fns)
    for _ in range(5):
        for name in order:
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            results[name].append((time.perf_counter() - start) / calls * 1e6)
        order.reverse()
    return {name: statistics.median(v) for name, v in results.items()}


@torch.inference_mode()
def bench_shape(B, hq, hkv, n, d, dtype, min_seconds, threads, extra_isa=None, mask_kind="none"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, hq, 1, d, generator=g).to(dtype)
    k = torch.randn(B, hkv, n, d, generator=g).to(dtype)
    v = torch.randn(B, hkv, n, d, generator=g).to(dtype)
    # The same keys, in a cache with room for 256 more, as a generating model keeps it.
    k_cache = torch.zeros(B, hkv, n + 256, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:, :, :n] = k
    v_cache[:, :, :n] = v
    seqlens = torch.full((B,), n, dtype=torch.int32)
    mask = None
    if mask_kind != "none":
        keep = torch.ones(B, 1, 1, n, dtype=torch.bool)
        for i in range(B):
            keep[i, ..., : (i * n) // (2 * B)] = False  # left padding: 0, 1/(2B), 2/(2B), ... of the keys
        mask = keep if mask_kind == "bool" else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True,
                                         attn_mask=None if mask is None else mask if mask.dtype == torch.bool
                                         else mask.float())
    ref_kv = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    for name, out, want in (("ours", cs149gpt.attention(q, k, v, attn_mask=mask), ref),
                            ("kvcache", cs149gpt.attention_with_kvcache(q, k_cache, v_cache, seqlens, is_causal=False),
                             ref_kv)):
        err = (out.float() - want).abs().max().item()
        assert err < (1e-4 if dtype == torch.float32 else 3e-2), f"{name} is wrong: max error {err}"
    nbytes = 2 * B * hkv * n * d * q.element_size()
    m = _ext.load()
    probe_buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    fns = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, attn_mask=mask),
        "ours": lambda: cs149gpt.attention(q, k, v, attn_mask=mask),
        "kvcache": lambda: cs149gpt.attention_with_kvcache(q, k_cache, v_cache, seqlens, is_causal=False),
        "probe": lambda: m.read_probe(probe_buffer, threads),
    }
    if extra_isa and dtype != torch.float32:  # float32 runs the same code under every AVX-512 ISA
        isa = m.isa()

        def ours_extra():
            m.set_isa(extra_isa)
            try:
                return cs149gpt.attention(q, k, v, attn_mask=mask)
            finally:
                m.set_isa(isa)

        fns["extra"] = ours_extra
    return time_calls(fns, min_seconds), nbytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,all")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--keys", default="1024,2048,4096,8192")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--heads", default="32,8", help="Hq,Hkv")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=0.5, help="time per shape and implementation")
    parser.add_argument("--extra-isa", default=None, help="also time ours under this ISA (e.g. avx512), same rounds")
    parser.add_argument("--mask", default="none", choices=("none", "bool", "additive"),
                        help="a key-padding attn_mask for ours and SDPA (B, 1, 1, N)")
    args = parser.parse_args()
    all_threads = torch.get_num_threads()
    threads = [all_threads if t == "all" else int(t) for t in args.threads.split(",")]
    hq, hkv = (int(x) for x in args.heads.split(","))
    d = args.head_dim
    print(f"cs149gpt {cs149gpt.isa()}, torch {torch.__version__}, {all_threads} cores; Hq={hq}, Hkv={hkv}, d={d}; "
          f"attn_mask: {args.mask}")
    for t in threads:
        torch.set_num_threads(t)
        bw = read_bandwidth_gbs(t)
        print(f"\n## {t} thread(s): read bandwidth probe {bw:.1f} GB/s (1 GiB)\n")
        extra = f" ours@{args.extra_isa} µs | @{args.extra_isa} ×SDPA |" if args.extra_isa else ""
        print("| dtype | B | keys | SDPA µs | ours µs | kvcache µs | ours ×SDPA | kvcache ×SDPA | ours GB/s | probe GB/s "
              f"| ours % bw |{extra}")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if extra else ""))
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            for B in (int(b) for b in args.batches.split(",")):
                for n in [128] + [int(x) for x in args.keys.split(",")]:
                    us, nbytes = bench_shape(B, hq, hkv, n, d, dtype, args.seconds, t, args.extra_isa, args.mask)
                    gbs = nbytes / (us["ours"] * 1e-6) / 1e9
                    probe_gbs = nbytes / (us["probe"] * 1e-6) / 1e9
                    extra = ""
                    if args.extra_isa:
                        extra = (f" {us['extra']:.1f} | {us['sdpa'] / us['extra']:.2f} |" if "extra" in us
                                 else " — | — |")
                    print(f"| {dname} | {B} | {n} | {us['sdpa']:.1f} | {us['ours']:.1f} | {us['kvcache']:.1f} | "
                          f"{us['sdpa'] / us['ours']:.2f} | {us['sdpa'] / us['kvcache']:.2f} | {gbs:.1f} | "
                          f"{probe_gbs:.1f} | {100 * us['probe'] / us['ours']:.0f} % |{extra}", flush=True)


if __name__ == "__main__":
    main()
