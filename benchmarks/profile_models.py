#!/usr/bin/env python3
"""Where a Hugging Face Llama's padded prefill (or BERT's right-padded encoding) spends its time with our attention
and with torch's SDPA: torch.profiler's operators by self CPU time, both attentions on the same model, same run.
--compile runs the model under torch.compile, with each inductor kernel recorded as its own operator.

    python benchmarks/profile_models.py --dtype bfloat16 --threads 1
    python benchmarks/profile_models.py --model bert --batch 32 --seq 128
    python benchmarks/profile_models.py --compile
    python benchmarks/profile_models.py --generate static --threads 16   # greedy generate, 16 new tokens
"""
import argparse
import time
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cs149gpt  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--model", choices=("llama", "bert"), default="llama")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--generate", choices=("dynamic", "static"), default=None,
                        help="profile Llama's greedy generate (--new-tokens) with this cache instead of one forward")
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    import transformers

    cs149gpt.register_transformers()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model == "llama":
        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                          max_position_embeddings=4096, pad_token_id=0, eos_token_id=None)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    else:
        config = transformers.BertConfig(vocab_size=1000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                         intermediate_size=1024, max_position_embeddings=4096, pad_token_id=0)
        model = transformers.AutoModel.from_config(config, attn_implementation="sdpa")
    model = model.to(getattr(torch, args.dtype)).eval()
    ids = torch.randint(1, 1000, (args.batch, args.seq))
    mask = torch.ones(args.batch, args.seq, dtype=torch.long)
    for i in range(args.batch):
        pad = (i * args.seq) // (2 * args.batch)
        if args.model == "llama":
            mask[i, :pad] = 0  # left padding
        else:
            mask[i, args.seq - pad:] = 0  # right padding
    if args.compile:
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # each generated kernel its own profiler event
    print(f"# torch {torch.__version__}, isa {cs149gpt.isa()}, {args.model}, {args.dtype}, {args.threads} thread(s), "
          f"batch {args.batch} x {args.seq} padded{', torch.compile' if args.compile else ''}"
          f"{f', generate {args.new_tokens} tokens, {args.generate} cache' if args.generate else ''}")
    for impl in ("sdpa", "cs149gpt", "sdpa", "cs149gpt"):
        model.set_attn_implementation(impl)
        run = model
        if args.generate:
            def run(input_ids, attention_mask):
                return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                      max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0,
                                      cache_implementation=args.generate)
        if args.compile:  # compiled afresh for each attention (switching a compiled model's fails dynamo's guards)
            torch._dynamo.reset()
            run = torch.compile(model)
        with torch.no_grad():
            run(input_ids=ids, attention_mask=mask)  # warm (and compile)
            start = time.perf_counter()
            for _ in range(3):
                run(input_ids=ids, attention_mask=mask)
            wall = (time.perf_counter() - start) / 3 * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                run(input_ids=ids, attention_mask=mask)
        total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
        print(f"\n## {impl}: {wall:.1f} ms a call (wall, unprofiled), {total:.1f} ms of self CPU time profiled")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
