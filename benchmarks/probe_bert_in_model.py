#!/usr/bin/env python3
"""Why an attention call inside BERT can cost more than the same call alone (issue 11: on the 16-core device host,
session 7's profile showed ~2 ms a call in the model against ~0.9 ms alone). One process, both attentions:

  model     the whole forward (BERT as bench_models.py builds it, a right-padded batch), ours and torch's SDPA
            alternating, median of the rounds;
  in model  each attention call timed where the model makes it (a wrapper around the function the model calls:
            ours for attn_implementation="cs149gpt", torch.nn.functional's for "sdpa"), median over the calls;
  replay    the first layer's call replayed alone with the very tensors the model passed (their layouts, the mask
            transformers built), back to back, median;
  faults    minor page faults (the process's, all threads) during a call, median: memory the allocator handed back
            to the system and took again.

    python benchmarks/probe_bert_in_model.py --threads 16 --dtype float32 --batch 32 --seq 128
"""
import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cs149gpt  # noqa: E402
from cs149gpt import integration  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="16")
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import transformers

    cs149gpt.register_transformers()
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, isa {cs149gpt.isa()}, BERT 4 layers "
          f"hidden 512, 8 heads, batch {args.batch} x {args.seq} right-padded")
    print("| dtype | threads | impl | model ms | attention in model, ms a call | same call alone, ms | page faults a call "
          "(in model / alone) | page faults a forward | mask |")
    print("|---|---|---|---|---|---|---|---|---|")
    torch_sdpa, our_sdpa = F.scaled_dot_product_attention, integration.ops.scaled_dot_product_attention
    calls = {"sdpa": [], "cs149gpt": []}
    call_faults = {"sdpa": [], "cs149gpt": []}
    captured = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            if name not in captured:
                captured[name] = (a, kw)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            out = fn(*a, **kw)
            calls[name].append(time.perf_counter() - start)
            call_faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            return out
        return wrapper

    F.scaled_dot_product_attention = timed("sdpa", torch_sdpa)
    integration.ops.scaled_dot_product_attention = timed("cs149gpt", our_sdpa)
    try:
        for dtype in (getattr(torch, name) for name in args.dtype.split(",")):
            config = transformers.BertConfig(vocab_size=1000, hidden_size=512, num_hidden_layers=4,
                                             num_attention_heads=8, intermediate_size=1024,
                                             max_position_embeddings=4096, pad_token_id=0)
            torch.manual_seed(0)
            model = transformers.AutoModel.from_config(config, attn_implementation="sdpa").to(dtype).eval()
            ids = torch.randint(1, 1000, (args.batch, args.seq))
            mask = torch.ones(args.batch, args.seq, dtype=torch.long)
            for i in range(args.batch):
                mask[i, args.seq - (i * args.seq) // (2 * args.batch):] = 0
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                wall = {"sdpa": [], "cs149gpt": []}
                model_faults = {"sdpa": [], "cs149gpt": []}
                captured.clear()
                with torch.no_grad():
                    for r in range(args.rounds + 1):
                        for impl in ("sdpa", "cs149gpt"):
                            model.set_attn_implementation(impl)
                            calls[impl].clear()
                            call_faults[impl].clear()
                            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                            start = time.perf_counter()
                            model(input_ids=ids, attention_mask=mask)
                            if r > 0:  # the first round warms
                                wall[impl].append(time.perf_counter() - start)
                                model_faults[impl].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
                                in_model[impl] = in_model.get(impl, []) + calls[impl]
                                faults_in_model[impl] = faults_in_model.get(impl, []) + call_faults[impl]
                    for impl, fn in (("sdpa", torch_sdpa), ("cs149gpt", our_sdpa)):
                        a, kw = captured[impl]
                        alone, alone_faults = [], []
                        for _ in range(30):
                            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                            start = time.perf_counter()
                            fn(*a, **kw)
                            alone.append(time.perf_counter() - start)
                            alone_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
                        m = kw.get("attn_mask")
                        desc = "none" if m is None else f"{m.dtype} {tuple(m.shape)} strides {m.stride()}"
                        print(f"| {str(dtype)[6:]} | {threads} | {impl} | {statistics.median(wall[impl]) * 1e3:.2f} | "
                              f"{statistics.median(in_model[impl]) * 1e3:.3f} | "
                              f"{statistics.median(alone[5:]) * 1e3:.3f} | "
                              f"{statistics.median(faults_in_model[impl]):.0f} / {statistics.median(alone_faults[5:]):.0f} | "
                              f"{statistics.median(model_faults[impl]):.0f} | "
                              f"{desc} |")
                in_model.clear()
                faults_in_model.clear()
    finally:
        F.scaled_dot_product_attention = torch_sdpa
        integration.ops.scaled_dot_product_attention = our_sdpa
    return 0


in_model, faults_in_model = {}, {}

if __name__ == "__main__":
    sys.exit(main())
