#!/usr/bin/env python3
"""Why a whole model can be slower with a faster attention: a Hugging Face Llama's left-padded prefill, timed with
torch's SDPA and with ours, alternating, same model, same run, with the process's minor page faults per forward and
torch.profiler's per-operator self time summed over the profiled forwards, side by side.

Variants, in this order (each a hypothesis for the gap seen at bfloat16 on one thread of the device host's Xeon):
  ours/amx, ours/avx512_bf16   the AMX tile state our kernel leaves behind (the second never touches the tiles);
  then with glibc told never to trim the heap nor mmap (mallopt): page faults of fresh allocations;
and a sandwich: a bf16 matmul written in place (no allocation), timed right after each attention.

    python benchmarks/probe_prefill_gap.py --dtype bfloat16 --threads 1
"""
import argparse
import collections
import ctypes
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cs149gpt  # noqa: E402
from cs149gpt import _ext  # noqa: E402


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, default=14)
    args = parser.parse_args()
    import transformers

    cs149gpt.register_transformers()
    module = _ext.load()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                                      pad_token_id=0, eos_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype).eval()
    batch, seq = 4, 512
    ids = torch.randint(1, 1000, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(batch):
        mask[i, : (i * seq) // (2 * batch)] = 0
    native_isa = module.isa()
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, isa {native_isa}, {args.dtype}, "
          f"{args.threads} thread(s), batch {batch} x {seq} left-padded, Llama 4 layers hidden 512 (8/2 heads)")

    variants = [("sdpa", "sdpa", native_isa), ("ours", "cs149gpt", native_isa)]
    if native_isa == "amx":
        variants.append(("ours/avx512_bf16", "cs149gpt", "avx512_bf16"))

    def forward(impl, isa):
        model.set_attn_implementation(impl)
        module.set_isa(isa)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)

    def timed_rounds(label):
        samples = collections.defaultdict(list)
        for v in variants:
            forward(v[1], v[2])  # warm
        for _ in range(args.rounds):
            for name, impl, isa in variants:
                model.set_attn_implementation(impl)
                module.set_isa(isa)
                f0, t0 = faults(), time.perf_counter()
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=mask)
                samples[name].append((time.perf_counter() - t0, faults() - f0))
        print(f"\n## whole prefill, {label}: median of {args.rounds} alternating rounds")
        print("| variant | ms | ×SDPA | minor faults |")
        print("|---|---:|---:|---:|")
        base = statistics.median(t for t, _ in samples["sdpa"])
        for name, values in samples.items():
            ms = statistics.median(t for t, _ in values)
            print(f"| {name} | {ms * 1e3:.1f} | {base / ms:.2f} | {int(statistics.median(f for _, f in values))} |")

    timed_rounds("glibc malloc defaults")

    # Per operator: self CPU time summed over profiled forwards of each variant.
    ops = collections.defaultdict(lambda: collections.defaultdict(float))
    for _ in range(3):
        for name, impl, isa in variants:
            model.set_attn_implementation(impl)
            module.set_isa(isa)
            with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                model(input_ids=ids, attention_mask=mask)
            for e in prof.key_averages():
                ops[e.key][name] += e.self_cpu_time_total / 3e3
    names = [v[0] for v in variants]
    print("\n## self CPU ms per forward by operator (mean of 3 profiled forwards each)")
    print("| operator | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    total = {n: sum(ops[k][n] for k in ops) for n in names}
    for key in sorted(ops, key=lambda k: -max(ops[k].values()))[: args.rows]:
        print(f"| {key} | " + " | ".join(f"{ops[key][n]:.2f}" for n in names) + " |")
    print("| total | " + " | ".join(f"{total[n]:.2f}" for n in names) + " |")

    # A matmul in place right after one attention call of the model's shape: what the attention leaves behind.
    q = torch.randn(batch, 8, seq, 64, dtype=dtype)
    k = torch.randn(batch, 2, seq, 64, dtype=dtype)
    v = torch.randn(batch, 2, seq, 64, dtype=dtype)
    a = torch.randn(batch * seq, 512, dtype=dtype)
    w = torch.randn(512, 1024, dtype=dtype)
    c = torch.empty(batch * seq, 1024, dtype=dtype)
    attentions = {
        "none": lambda: None,
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "ours": lambda: cs149gpt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }
    module.set_isa(native_isa)
    after = collections.defaultdict(list)
    for _ in range(20):
        for name, fn in attentions.items():
            fn()
            t0 = time.perf_counter()
            torch.mm(a, w, out=c)
            after[name].append(time.perf_counter() - t0)
    print("\n## torch.mm(out=) (2048x512 @ 512x1024) right after one attention call: median of 20, µs")
    print(" | ".join(f"{n}: {statistics.median(t) * 1e6:.0f}" for n, t in after.items()))

    # The same rounds once glibc keeps every freed page: no trimming, no mmap for large blocks.
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 1 << 29)
    if ok:
        timed_rounds("mallopt: no trim, no mmap")
    module.set_isa(native_isa)
    return 0


if __name__ == "__main__":
    sys.exit(main())
