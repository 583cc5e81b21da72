#!/usr/bin/env python3
"""Whole-model time of Hugging Face transformers models on our attention against torch's SDPA, same run.

A Llama (GQA) built from a config (nothing downloaded, random weights) with attn_implementation="cs149gpt"
(cs149gpt.register_transformers()) and the same weights with "sdpa": a padded batch's prefill (one forward pass),
greedy generation (prefill + new tokens) with the dynamic cache and with a static one (a mask on every step), the
prefill under torch.compile (where transformers always builds a mask; --compile, compiles take minutes), for
GPT-2 a training step (forward + backward, attention dropout 0.1: ours runs it in the kernel, torch's in its SDPA),
and a BERT encoder on a right-padded batch (a (B, 1, 1, N) key-padding mask), inference and a training step (dropout
0.1).

    python benchmarks/bench_models.py                       # 1 thread
    python benchmarks/bench_models.py --threads 1,16 --batch 4 --seq 1024
    python benchmarks/bench_models.py --models bert --batch 32 --seq 128   # sentence-embedding-sized batches

×SDPA = SDPA's median / ours (> 1: ours faster); one model per architecture, switched between the two attentions
(set_attn_implementation) in alternating rounds, so both run the same weights at the same addresses. Needs
transformers.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cs149gpt  # noqa: E402


def median_times(model, fns: dict, repeats: int) -> dict:
    """Median seconds of each attention implementation on one model (the same weights in memory for both, switched
    with set_attn_implementation), in rounds that alternate their order after a warm-up call of each."""
    samples = {impl: [] for impl in fns}
    order = list(fns)
    for round_ in range(repeats + 1):
        for impl in order:
            model.set_attn_implementation(impl)
            start = time.perf_counter()
            fns[impl]()
            if round_ > 0:
                samples[impl].append(time.perf_counter() - start)
        order.reverse()
    return {impl: statistics.median(v) for impl, v in samples.items()}


def padded(batch: int, seq: int, vocab: int, g: torch.Generator, side: str = "left"):
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(batch):
        pad = (i * seq) // (2 * batch)  # 0, 1/8, 2/8, ... of the sequence (batch 4)
        if side == "left":
            mask[i, :pad] = 0
        else:
            mask[i, seq - pad:] = 0
    return ids, mask


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile", action="store_true", help="add Llama's prefill under torch.compile")
    parser.add_argument("--models", default="llama,gpt2,bert",
                        help="which of llama (prefill, generate with a dynamic and a static cache), gpt2 (train "
                             "step), bert (encoder, and its training step)")
    args = parser.parse_args()
    import transformers

    cs149gpt.register_transformers()
    dtype = getattr(torch, args.dtype)
    llama = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0,
                 eos_token_id=None)
    gpt2 = dict(vocab_size=1000, n_positions=4096, n_embd=512, n_layer=4, n_head=8, pad_token_id=0,
                eos_token_id=None)
    bert = dict(vocab_size=1000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=1024,
                max_position_embeddings=4096, pad_token_id=0)
    # One model each, switched between the two attentions: the same weights, at the same addresses, for both.
    torch.manual_seed(0)
    models = {"llama": transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**llama), attn_implementation="sdpa").to(dtype).eval()}
    torch.manual_seed(0)
    models["gpt2"] = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(**gpt2), attn_implementation="sdpa").to(dtype).train()
    torch.manual_seed(0)
    models["bert"] = transformers.AutoModel.from_config(
        transformers.BertConfig(**bert), attn_implementation="sdpa").to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    ids, mask = padded(args.batch, args.seq, 1000, g)
    right_mask = padded(args.batch, args.seq, 1000, g, side="right")[1]
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, isa {cs149gpt.isa()}, "
          f"{args.dtype}, batch {args.batch} x {args.seq} tokens (left-padded; BERT right-padded), 4 layers, "
          f"hidden 512")
    print("| model | phase | threads | SDPA ms | cs149gpt ms | ×SDPA |")
    print("|---|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        # Under torch.compile, one copy of the Llama per attention (the same weights), each compiled once and never
        # switched: switching one compiled model's attention fails dynamo's guards and reloads a graph per call.
        # Static shapes for both (dynamic=False): the second twin recompiles the frames the first compiled, and
        # dynamo's automatic dynamic shapes would make only its graphs dynamic.
        # Compiled afresh for each thread count (inductor's kernels take the thread count they are compiled with),
        # in median_times' warm-up round (not timed).
        compiled = {}
        if args.compile:
            torch._dynamo.reset()
            for impl in ("sdpa", "cs149gpt"):
                twin = copy.deepcopy(models["llama"])
                twin.set_attn_implementation(impl)
                compiled[impl] = torch.compile(twin, dynamic=False)
        phases = {
            ("llama", "prefill"): lambda m: m(input_ids=ids, attention_mask=mask),
            ("llama", "prefill, torch.compile"): None,  # compiled[impl], below
            ("llama", f"generate {args.new_tokens}"): lambda m: m.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                do_sample=False, pad_token_id=0),
            ("llama", f"generate {args.new_tokens}, static cache"): lambda m: m.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                do_sample=False, pad_token_id=0, cache_implementation="static"),
            ("gpt2", "train step (dropout 0.1)"): lambda m: m(input_ids=ids, attention_mask=mask,
                                                              labels=ids).loss.backward(),
            ("bert", "encode (right-padded)"): lambda m: m.eval()(input_ids=ids, attention_mask=right_mask),
            # fine-tuning: dropout 0.1 on the attention weights and the padding mask, forward + backward
            ("bert", "train step (right-padded, dropout 0.1)"): lambda m: m.train()(
                input_ids=ids, attention_mask=right_mask).last_hidden_state.square().mean().backward(),
        }
        for (name, phase), fn in phases.items():
            if name not in args.models.split(",") or (phase.endswith("compile") and not compiled):
                continue
            model = models[name]
            if fn is None:
                fns = {impl: lambda impl=impl: compiled[impl](input_ids=ids, attention_mask=mask) for impl in compiled}
            else:
                fns = {impl: lambda: fn(model) for impl in ("sdpa", "cs149gpt")}
            grad = torch.enable_grad() if phase.startswith("train") else torch.no_grad()
            with grad:
                times = median_times(model, fns, args.repeats)
            print(f"| {name} | {phase} | {threads} | {times['sdpa'] * 1e3:.1f} | {times['cs149gpt'] * 1e3:.1f} | "
                  f"{times['sdpa'] / times['cs149gpt']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
