#!/usr/bin/env python3
"""Generation speed of the shipped GPT with our attention against PyTorch SDPA, prefill and decode apart.

For each context length N (the models shakes128, shakes1024, shakes2048) and thread count:

    prefill  one forward of an N-token prompt into an empty KV cache: N queries, causal    -> N / time
    decode   the last D of the N tokens, one forward each against the cache: 1 query vs ~N keys -> D / time

with the model's attention SDPA (part0), flash (part4) and, by default, fused (part3). Everything else in the
model is the same PyTorch code, so the ratio ×SDPA is what the attention kernel buys end to end. Medians of
--repeats measurements, taken in rounds that alternate the order of the implementations.

    python benchmarks/bench_generate.py                          # contexts 128,1024,2048; threads 1,all
    python benchmarks/bench_generate.py --contexts 2048 --threads all --impls flash --repeats 3
    python benchmarks/bench_generate.py --agreement 2000         # also: how often a part samples another token
    python benchmarks/bench_generate.py --llama --contexts 1024,4096 --threads all --impls flash
    python benchmarks/bench_generate.py --llama --contexts 8192 --batch 8 --decode-only --decode 8 --impls flash

--llama measures a Llama-shaped model instead of the shipped one: GQA with 32 query heads on 8 kv heads, head size
128 (n_embd 4096), bfloat16, a 32000-token vocabulary, --llama-layers layers (default 2) of random weights (speed
only: nothing is sampled from it). Decoding there is what LLM users run: one query against a long bf16 cache per
layer, with the model's weights read once per token beside it.

--batch B decodes B sequences together (tokens/s counts all of them). --decode-only skips the prefill: the caches
are filled with random keys and values (KVCache.append) to the context's length, then --decode tokens are timed;
a decode step's cost does not depend on what the cache holds, and a long batched context (where reading the
cache, not the weights, is most of a token's time) is then measurable without minutes of prefill.

--agreement N writes N tokens with SDPA from a fixed seed, then replays them through each part (same prompt,
same random numbers) and reports, per decoding step, the largest |logit difference| from SDPA, whether the
sampled token flips, whether the likeliest token (temperature 0) flips, and the chance of a flip: sampling draws
one uniform u per token and inverts the CDF, so the two pick different tokens only when u falls between their
CDFs, with probability at most sum_i |CDF_part(i) - CDF_sdpa(i)|. Then each part writes freely, and the table
says where its text first differs from SDPA's.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import cs149gpt  # noqa: E402
from cs149gpt.model import GPT, GPTConfig, load_pretrained, sample_next  # noqa: E402

MODEL_FOR_CONTEXT = {128: "shakes128", 256: "shakes256", 1024: "shakes1024", 2048: "shakes2048"}
# Llama-3-8B's attention shape (and width), a few layers of it.
LLAMA = dict(vocab_size=32000, n_head=32, n_kv_head=8, n_embd=4096, bias=False)


def llama_model(block_size: int, layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=block_size, n_layer=layers, **LLAMA)).eval().to(torch.bfloat16)


def time_prefill(model: GPT, prompt: torch.Tensor) -> float:
    caches = model.new_kv_caches(prompt.size(0))
    start = time.perf_counter()
    model(prompt, kv_caches=caches)
    return time.perf_counter() - start


def filled_caches(model: GPT, batch: int, length: int):
    """The model's KV caches holding `length` random keys and values per sequence (no forward run)."""
    caches = model.new_kv_caches(batch)
    g = torch.Generator().manual_seed(1)
    for cache in caches:
        shape = (batch, cache.k.size(1), length, cache.k.size(3))
        k, v = (torch.randn(shape, generator=g).to(cache.k.dtype) for _ in range(2))
        cache.append(k, v)
    return caches


def time_decode(model: GPT, tokens: torch.Tensor, decode: int, fill: bool = False) -> float:
    """Seconds to decode the last `decode` of tokens (B, N) one at a time, after prefilling the rest (untimed; with
    fill, random keys and values instead of a prefill)."""
    if fill:
        caches = filled_caches(model, tokens.size(0), tokens.size(1) - decode)
    else:
        caches = model.new_kv_caches(tokens.size(0))
        model(tokens[:, :-decode], kv_caches=caches)
    start = time.perf_counter()
    for t in range(tokens.size(1) - decode, tokens.size(1)):
        model(tokens[:, t:t + 1], kv_caches=caches)
    return time.perf_counter() - start


@torch.inference_mode()
def bench(contexts: List[int], threads: List[int], impls: List[str], decode: int, repeats: int,
          llama_layers: int = 0, batch: int = 1, decode_only: bool = False) -> List[Dict]:
    rows = []
    for n in contexts:
        if llama_layers:
            model = llama_model(n, llama_layers)
            vocab_size = LLAMA["vocab_size"]
        else:
            model, vocab = load_pretrained(MODEL_FOR_CONTEXT[n])
            vocab_size = len(vocab)
        tokens = torch.randint(vocab_size, (batch, n), generator=torch.Generator().manual_seed(0))
        for t in threads:
            torch.set_num_threads(t)
            for phase in ("decode",) if decode_only else ("prefill", "decode"):
                seconds = {impl: [] for impl in impls}
                order = list(impls)
                for _ in range(repeats + 1):  # the first round warms up: caches, pages, OpenMP's threads
                    for impl in order:
                        model.set_attention(impl)
                        s = (time_prefill(model, tokens) if phase == "prefill"
                             else time_decode(model, tokens, decode, decode_only))
                        seconds[impl].append(s)
                    order.reverse()
                count = batch * (n if phase == "prefill" else decode)
                rate = {impl: count / statistics.median(s[1:]) for impl, s in seconds.items()}
                rows.append(dict(context=n, threads=t, phase=phase, rate=rate))
                print(f"  context {n:>4}, {t} thread(s), {phase:<7}: " +
                      ", ".join(f"{impl} {r:,.0f} tok/s" for impl, r in rate.items()), file=sys.stderr, flush=True)
    return rows


def markdown_table(rows: List[Dict], impls: List[str], decode: int) -> str:
    ours = [i for i in impls if i != "sdpa"]
    header = ["context", "threads", "phase", "SDPA tok/s"] + [c for i in ours for c in (f"{i} tok/s", f"{i} ×SDPA")]
    align = ["---:", "---:", ":---"] + ["---:"] * (len(header) - 3)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        cells = [str(r["context"]), str(r["threads"]),
                 r["phase"] if r["phase"] == "prefill" else f"decode ({decode})", f"{r['rate']['sdpa']:,.0f}"]
        for i in ours:
            cells += [f"{r['rate'][i]:,.0f}", f"{r['rate'][i] / r['rate']['sdpa']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@torch.inference_mode()
def agreement(model_name: str, tokens: int, seed: int = 0) -> str:
    """How far each part's logits stray from SDPA's along one generation, and whether a sampled token flips."""
    model, vocab = load_pretrained(model_name)
    prompt = torch.tensor([vocab.encode("\n")])

    def replay(impl: str, written: List[int]):
        """Per step: impl's logits along SDPA's text, and the token it samples with SDPA's draw."""
        model.set_attention(impl)
        caches = model.new_kv_caches(1)
        generator = torch.Generator().manual_seed(seed)
        logits, _ = model(prompt, kv_caches=caches)
        steps = []
        for t in range(tokens):
            last = logits[:, -1, :]
            steps.append((last, int(sample_next(last, generator=generator))))
            if t + 1 < tokens:
                logits, _ = model(torch.tensor([[written[t]]]), kv_caches=caches)
        return steps

    def free_run(impl: str) -> List[int]:
        model.set_attention(impl)
        return [int(t) for t in model.generate(prompt, tokens, generator=torch.Generator().manual_seed(seed))]

    assert tokens < model.config.block_size, "replay keeps every token in the cache: stay inside the context"
    written = free_run("sdpa")
    reference = replay("sdpa", written)
    lines = [f"{model_name}, seed {seed}, {tokens} tokens (temperature 1), each part against SDPA along SDPA's text:",
             "| part | max \\|Δlogit\\| | median per-step max | sampled token flips | argmax flips | "
             "expected flips (Σ per-step bound) | own text first differs at |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    ref_logits = torch.cat([logits for logits, _ in reference])  # (tokens, V)
    ref_cdf = torch.softmax(ref_logits, dim=-1).cumsum(dim=-1)
    for impl in cs149gpt.IMPLS:
        steps = replay(impl, written)
        logits = torch.cat([step_logits for step_logits, _ in steps])  # (tokens, V)
        per_step = (logits - ref_logits).abs().amax(dim=-1)  # (tokens,)
        flips = sum(a != b for (_, a), (_, b) in zip(steps, reference))
        argmax_flips = int((logits.argmax(-1) != ref_logits.argmax(-1)).sum())
        flip_bound = (torch.softmax(logits, dim=-1).cumsum(dim=-1) - ref_cdf).abs().sum().item()
        own = free_run(impl)
        differs = next((i for i, (a, b) in enumerate(zip(own, written)) if a != b), None)
        lines.append(f"| {impl} | {per_step.max().item():.2e} | {per_step.median().item():.2e} | {flips} / {tokens} | "
                     f"{argmax_flips} / {tokens} | {flip_bound:.1e} | {'never' if differs is None else differs} |")
    return "\n".join(lines)


def parse_list(text: str, all_value: int) -> List[int]:
    return [all_value if x == "all" else int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="128,1024,2048",
                        help="comma-separated, of 128,256,1024,2048; empty: no speed table (with --agreement)")
    parser.add_argument("--threads", default="1,all", help="comma-separated thread counts; all = every core")
    parser.add_argument("--impls", default="flash,fused", help=f"ours, comma-separated, of {','.join(cs149gpt.IMPLS)}")
    parser.add_argument("--decode", type=int, default=64, help="decoded tokens per measurement (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per cell, median taken (default 5)")
    parser.add_argument("--llama", action="store_true", help="a Llama-shaped bf16 GQA model instead (see above)")
    parser.add_argument("--llama-layers", type=int, default=2, help="layers of the --llama model (default 2)")
    parser.add_argument("--batch", type=int, default=1, help="sequences generated together (default 1)")
    parser.add_argument("--decode-only", action="store_true",
                        help="no prefill: random caches of the context's length, decode timed alone (see above)")
    parser.add_argument("--agreement", type=int, default=0, metavar="N",
                        help="also compare each part's sampling with SDPA's over N tokens of shakes2048")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    unknown = [c for c in contexts if c not in MODEL_FOR_CONTEXT]
    if unknown and not args.llama:
        parser.error(f"no model for context {unknown}; choose from {sorted(MODEL_FOR_CONTEXT)}")
    threads = parse_list(args.threads, torch.get_num_threads())
    impls = ["sdpa"] + args.impls.split(",")

    print(f"cs149gpt {cs149gpt.isa()}, torch {torch.__version__}, {torch.get_num_threads()} cores", file=sys.stderr)
    if contexts:
        rows = bench(contexts, threads, impls, args.decode, args.repeats, args.llama_layers if args.llama else 0,
                     args.batch, args.decode_only)
        if args.llama:
            print(f"\nLlama-shaped model: {args.llama_layers} layers, {LLAMA}, bfloat16, random weights.")
        print(f"\nGeneration tokens/s, median of {args.repeats}, batch {args.batch}; prefill: the whole N-token prompt "
              f"in one forward; decode: the last {args.decode} tokens of N, one forward each against the KV cache"
              f"{' (filled with random keys and values, no prefill)' if args.decode_only else ''}.\n")
        print(markdown_table(rows, impls, args.decode))
    if args.agreement:
        print()
        print(agreement("shakes2048", args.agreement))


if __name__ == "__main__":
    main()
