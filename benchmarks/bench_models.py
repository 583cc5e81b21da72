"""The whole-model subcommands of bench.py: models (Hugging Face transformers), generate, train, trainpacked.

Ours and the peer run the same weights: one model switched between the two attentions, or two copies of one.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time

import torch

from _timing import Row, first_line, interleave, torch_threads
from bench_cpu import varlen_lengths

import cs149gpt
from cs149gpt.model import GPT, GPTConfig, load_pretrained


def progress(text: str) -> None:
    print(f"  {text} ...", file=sys.stderr, flush=True)


def pair_row(bench: str, case: str, dtype: str, threads: int, ours: tuple, peer: tuple, args, *, count=None,
             unit="", self_timed=False, rounds=None) -> Row:
    """ours, peer: (name, callable); both already run once (the caller checked their answers)."""
    row = Row(bench, case, dtype, threads, ours[0], peer[0], unit=unit)
    with torch_threads(threads):
        t = interleave({ours[0]: ours[1], peer[0]: peer[1]}, rounds or args.rounds, args.seconds,
                       self_timed=self_timed)
    o, p = t[ours[0]], t[peer[0]]
    row.ours_ms, row.peer_ms, row.ratio = o.median * 1e3, p.median * 1e3, p.median / o.median
    if count:
        row.rate = count / o.median
    for who, tt in ((ours[0], o), (peer[0], p)):
        if tt.noisy:
            row.add_note(f"noisy: {who} IQR {100 * tt.iqr / tt.median:.0f}% of median")
    return row


# ------------------------------------------------------------------------------------------------- models
def padded(batch: int, seq: int, vocab: int, g: torch.Generator, side: str = "left"):
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(batch):
        pad = (i * seq) // (2 * batch)
        if side == "left":
            mask[i, :pad] = 0
        else:
            mask[i, seq - pad:] = 0
    return ids, mask


def run_models(args) -> list[Row]:
    """Random-weight Llama (GQA), GPT-2 and BERT built from configs (nothing downloaded), attention "cs149gpt"
    (cs149gpt.register_transformers()) against "sdpa" on the same weights, switched between calls."""
    try:
        import transformers
    except ImportError:
        print("models: transformers is not installed (pip install transformers); skipped", file=sys.stderr)
        return [Row("models", "all", "", None, "cs149gpt", "sdpa", status="skipped",
                    note="transformers is not installed")]
    cs149gpt.register_transformers()
    dtype = args.dtype[0] if args.dtype else "float32"
    batch, seq, layers, new = (2, 128, 2, 4) if args.quick else (args.batch, args.seq, 4, args.new_tokens)
    common = dict(vocab_size=1000, max_position_embeddings=4096, pad_token_id=0)
    configs = {
        "llama": transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                                          num_attention_heads=8, num_key_value_heads=2, eos_token_id=None, **common),
        "gpt2": transformers.GPT2Config(vocab_size=1000, n_positions=4096, n_embd=512, n_layer=layers, n_head=8,
                                        pad_token_id=0, eos_token_id=None),
        "bert": transformers.BertConfig(hidden_size=512, num_hidden_layers=layers, num_attention_heads=8,
                                        intermediate_size=1024, **common),
    }
    g = torch.Generator().manual_seed(0)
    ids, mask = padded(batch, seq, 1000, g)
    right_mask = padded(batch, seq, 1000, g, side="right")[1]
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
               pad_token_id=0)
    phases = {  # (model, phase): (call, train?)
        ("llama", "prefill"): (lambda m: m(input_ids=ids, attention_mask=mask).logits, False),
        ("llama", f"generate {new}"): (lambda m: m.generate(**gen), False),
        ("llama", f"generate {new}, static cache"): (lambda m: m.generate(**gen, cache_implementation="static"), False),
        ("gpt2", "train step (dropout 0.1)"): (lambda m: m(input_ids=ids, attention_mask=mask, labels=ids).loss
                                               .backward(), True),
        ("bert", "encode (right-padded)"): (lambda m: m(input_ids=ids, attention_mask=right_mask).last_hidden_state,
                                            False),
        ("bert", "train step (dropout 0.1)"): (lambda m: m(input_ids=ids, attention_mask=right_mask)
                                               .last_hidden_state.square().mean().backward(), True),
    }
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        auto = transformers.AutoModel if name == "bert" else transformers.AutoModelForCausalLM
        model = auto.from_config(configs[name], attn_implementation="sdpa").to(getattr(torch, dtype))
        for (model_name, phase), (fn, train) in phases.items():
            if model_name != name:
                continue
            model.train(train)
            case = f"{name} {phase}, {batch}x{seq}"

            def run(impl, fn=fn):
                model.set_attn_implementation(impl)
                return fn(model)

            for threads in args.threads:
                progress(f"models {case} threads={threads}")
                try:
                    with torch_threads(threads), (contextlib.nullcontext() if train else torch.no_grad()):
                        outs = {impl: run(impl) for impl in ("cs149gpt", "sdpa")}
                        err = None
                        if isinstance(outs["sdpa"], torch.Tensor) and outs["sdpa"].is_floating_point():
                            # padding positions left out: a row that sees no key is 0 in ours, torch's may differ
                            keep = (right_mask if name == "bert" else mask).bool()
                            err = (outs["cs149gpt"][keep].float() - outs["sdpa"][keep].float()).abs().max().item()
                        elif isinstance(outs["sdpa"], torch.Tensor):  # generated tokens
                            err = float((outs["cs149gpt"] != outs["sdpa"]).sum())
                        row = pair_row("models", case, dtype, threads, ("cs149gpt", lambda: run("cs149gpt")),
                                       ("sdpa", lambda: run("sdpa")), args)
                except Exception as e:  # noqa: BLE001  (an API this transformers lacks: say so, go on)
                    rows.append(Row("models", case, dtype, threads, "cs149gpt", "sdpa", status="error",
                                    note=f"{type(e).__name__}: {first_line(e)}"))
                    continue
                row.err = err
                tokens = isinstance(outs["sdpa"], torch.Tensor) and not outs["sdpa"].is_floating_point()
                if tokens and err:
                    row.add_note(f"{err:.0f} generated tokens differ (near-ties of random weights)")
                elif err is not None and not err <= (1e-3 if dtype == "float32" else 0.1):
                    row.status = "wrong"
                    row.add_note(f"WRONG: max |ours - sdpa| = {err:.3g}")
                rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------- generate
LLAMA = dict(vocab_size=32000, n_head=32, n_kv_head=8, n_embd=4096, bias=False)  # Llama-3-8B's attention shape


def run_generate(args) -> list[Row]:
    """The shipped GPT (or, with --llama, a Llama-shaped bf16 GQA model of random weights) with attention "flash"
    against "sdpa": prefill (an N-token prompt into an empty cache) and decode (the last D tokens one at a time)."""
    contexts = [128] if args.quick else args.contexts
    decode = 8 if args.quick else args.decode
    unknown = [n for n in contexts if n not in (128, 256, 1024, 2048)]
    if unknown and not args.llama:
        raise SystemExit(f"generate: no shipped model for context {unknown}: choose among 128,256,1024,2048")
    rows = []
    for n in contexts:
        if args.llama:
            torch.manual_seed(0)
            model = GPT(GPTConfig(block_size=n, n_layer=args.llama_layers, **LLAMA)).eval().to(torch.bfloat16)
            vocab_size, dtype, what = LLAMA["vocab_size"], "bfloat16", f"Llama-shaped {args.llama_layers}L"
        else:
            model, vocab = load_pretrained(f"shakes{n}")
            vocab_size, dtype, what = len(vocab), "float32", f"shakes{n}"
        tokens = torch.randint(vocab_size, (args.batch, n), generator=torch.Generator().manual_seed(0))

        def prefill(impl):
            model.set_attention(impl)
            caches = model.new_kv_caches(args.batch)
            start = time.perf_counter()
            model(tokens, kv_caches=caches)
            return time.perf_counter() - start

        def decode_steps(impl):
            model.set_attention(impl)
            caches = model.new_kv_caches(args.batch)
            model(tokens[:, :-decode], kv_caches=caches)  # untimed
            start = time.perf_counter()
            for t in range(n - decode, n):
                model(tokens[:, t:t + 1], kv_caches=caches)
            return time.perf_counter() - start

        for threads in args.threads:
            with torch.inference_mode():
                with torch_threads(threads):
                    model.set_attention("flash")
                    ours_logits = model(tokens)[0]
                    model.set_attention("sdpa")
                    err = (ours_logits.float() - model(tokens)[0].float()).abs().max().item()
                for phase, fn, count in (("prefill", prefill, args.batch * n), (f"decode {decode}", decode_steps,
                                                                                  args.batch * decode)):
                    case = f"{what} {phase}, context {n}, batch {args.batch}"
                    progress(f"generate {case} threads={threads}")
                    fn("flash"), fn("sdpa")  # warm-up: caches, pages, OpenMP's threads
                    row = pair_row("generate", case, dtype, threads, ("flash", lambda: fn("flash")),
                                   ("sdpa", lambda: fn("sdpa")), args, count=count, unit="tok/s", self_timed=True,
                                   rounds=max(args.rounds, 3))
                    row.err = err
                    if not err <= (1e-3 if dtype == "float32" else 0.5):
                        row.status = "wrong"
                        row.add_note(f"WRONG: logits differ by {err:.3g}")
                    rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------- train
CONFIGS = {  # (config, batch)
    "shipped": (GPTConfig(), 16),  # cs149gpt/train.py's pretraining: 4 layers, 4 heads of 32, T = 256
    "shipped2048": (GPTConfig(block_size=2048), 2),
    "nano256": (GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384), 16),  # nanoGPT's Shakespeare-char
    "nano512": (GPTConfig(block_size=512, n_layer=6, n_head=6, n_embd=384), 8),
}


def run_train(args) -> list[Row]:
    """Training steps of cs149gpt/model.py (forward, cross-entropy, backward, clipping, AdamW: train.py's loop), two
    copies of one model on the same batches, flash against sdpa, steps interleaved. float32, or bfloat16 as
    torch.autocast (float32 weights, the Linear layers and attention in bf16)."""
    rows = []
    for name in (["shipped"] if args.quick else args.configs):
        config, batch = CONFIGS[name]
        batch = 4 if args.quick else batch
        for dtype in args.dtype or ["float32"]:
            autocast = dtype != "float32"
            torch.manual_seed(0)
            base = GPT(copy.deepcopy(config))
            models = {}
            for impl in ("flash", "sdpa"):
                model = copy.deepcopy(base).set_attention(impl).train()
                models[impl] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
            g = torch.Generator().manual_seed(1)
            x, y = (torch.randint(config.vocab_size, (batch, config.block_size), generator=g) for _ in range(2))

            def step(impl):
                model, optimizer = models[impl]
                ctx = torch.autocast("cpu", dtype=DTYPE[dtype]) if autocast else contextlib.nullcontext()
                with ctx:
                    _, loss = model(x, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                return loss.item()

            for threads in args.threads:
                case = f"{name} ({config.n_layer}L {config.n_head}x{config.n_embd // config.n_head}, "\
                       f"B={batch} T={config.block_size}){' autocast' if autocast else ''}"
                progress(f"train {case} threads={threads}")
                with torch_threads(threads):
                    losses = {impl: step(impl) for impl in models}  # the first step: the losses must agree
                row = pair_row("train", case, dtype, threads, ("flash", lambda: step("flash")),
                               ("sdpa", lambda: step("sdpa")), args, count=batch * config.block_size, unit="tok/s")
                row.err = abs(losses["flash"] - losses["sdpa"])
                if not row.err <= (1e-4 if not autocast else 5e-2) * max(1.0, abs(losses["sdpa"])):
                    row.status = "wrong"
                    row.add_note(f"WRONG: first losses {losses['flash']:.5f} vs {losses['sdpa']:.5f}")
                rows.append(row)
    return rows


DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


# ------------------------------------------------------------------------------------------------- trainpacked
def run_trainpacked(args) -> list[Row]:
    """A padding-free training step of a random-weight Llama built from config: ours, attention
    cs149gpt.integration.register_transformers_flash(), is fed the sequences flattened into one row by
    DataCollatorWithFlattening (position_ids and cu_seq_lens: one varlen call per layer); the peer, the same weights
    on attention "sdpa", the same sequences right-padded to the longest with an attention_mask (labels -100 on the
    padding). Both predict the same tokens, so their first losses must agree. A step: forward, loss, backward,
    AdamW; after the first (the probe), one step a sample in interleaved rounds. The rate counts the real tokens
    (not the padding) per second. bfloat16 is torch.autocast (float32 weights and optimizer state, the Linear
    layers and attention in bf16)."""
    try:
        import transformers
        from transformers import DataCollatorWithFlattening
    except ImportError:
        print("trainpacked: transformers is not installed (pip install transformers); skipped", file=sys.stderr)
        return [Row("trainpacked", "all", "", None, "varlen", "sdpa padded", status="skipped",
                    note="transformers is not installed")]
    from cs149gpt.integration import register_transformers_flash

    ours_name = register_transformers_flash()
    if args.quick:
        hidden, layers, heads, lengths = 64, 2, 4, varlen_lengths(8, 16, 128)
    else:
        if len(args.seqs) != 3:
            raise SystemExit(f"trainpacked: --seqs is COUNT,SHORTEST,LONGEST, got {args.seqs}")
        hidden, layers, heads, lengths = args.hidden, args.layers, args.heads, varlen_lengths(*args.seqs)
    vocab = 1000
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=args.mlp_ratio * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=heads, max_position_embeddings=max(lengths),
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(
        [{"input_ids": s.tolist()} for s in sequences])
    packed["use_cache"] = False
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
    batches = {"varlen": packed, "sdpa padded": padded}
    real = sum(lengths)
    what = (f"Llama {layers}L {heads}x{hidden // heads}, {len(lengths)} seqs {min(lengths)}..{longest} "
            f"({real} tokens, padded {len(lengths) * longest})")

    rows = []
    for dtype in args.dtype or ["float32", "bfloat16"]:
        autocast = dtype != "float32"
        torch.manual_seed(0)
        base = transformers.LlamaForCausalLM(config)
        models = {}
        for name, impl in (("varlen", ours_name), ("sdpa padded", "sdpa")):
            model = copy.deepcopy(base).train()
            model.set_attn_implementation(impl)
            models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

        def step(name):
            model, optimizer = models[name]
            ctx = torch.autocast("cpu", dtype=DTYPE[dtype]) if autocast else contextlib.nullcontext()
            with ctx:
                loss = model(**batches[name]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            return loss.item()

        def timed_step(name):  # a step lasts seconds at full size: one step a sample, no calibration calls
            start = time.perf_counter()
            step(name)
            return time.perf_counter() - start

        case = f"{what}{' autocast' if autocast else ''}"
        for threads in args.threads:
            progress(f"trainpacked {case} {dtype} threads={threads}")
            try:
                with torch_threads(threads):
                    losses = {name: step(name) for name in models}  # the first step: the losses must agree
                row = pair_row("trainpacked", case, dtype, threads, ("varlen", lambda: timed_step("varlen")),
                               ("sdpa padded", lambda: timed_step("sdpa padded")), args, count=real, unit="tok/s",
                               self_timed=True)
            except Exception as e:  # noqa: BLE001  (an API this transformers lacks: say so, go on)
                rows.append(Row("trainpacked", case, dtype, threads, "varlen", "sdpa padded", status="error",
                                note=f"{type(e).__name__}: {first_line(e)}"))
                continue
            row.err = abs(losses["varlen"] - losses["sdpa padded"])
            if not row.err <= (1e-4 if not autocast else 5e-2) * max(1.0, abs(losses["sdpa padded"])):
                row.status = "wrong"
                row.add_note(f"WRONG: first losses {losses['varlen']:.5f} vs {losses['sdpa padded']:.5f}")
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------- command line
def register(sub, common: argparse.ArgumentParser) -> None:
    ints = lambda t: [int(x) for x in t.split(",")]  # noqa: E731
    p = sub.add_parser("models", parents=[common], help="Hugging Face Llama, GPT-2, BERT (random weights) vs sdpa")
    p.set_defaults(run=run_models)
    p.add_argument("--models", type=lambda t: t.split(","), default=["llama", "gpt2", "bert"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=16)
    p = sub.add_parser("generate", parents=[common], help="the shipped GPT's prefill and decode, flash vs sdpa")
    p.set_defaults(run=run_generate)
    p.add_argument("--contexts", type=ints, default=[128, 1024, 2048], help="of 128,256,1024,2048 (any with --llama)")
    p.add_argument("--decode", type=int, default=64, help="decoded tokens per measurement")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--llama", action="store_true", help="a Llama-shaped bf16 GQA model (32/8 heads of 128) instead")
    p.add_argument("--llama-layers", type=int, default=2)
    p = sub.add_parser("train", parents=[common], help="training steps of cs149gpt/model.py, flash vs sdpa")
    p.set_defaults(run=run_train)
    p.add_argument("--configs", type=lambda t: t.split(","), default=["shipped", "nano256"],
                   help=f"of {','.join(CONFIGS)}")
    p = sub.add_parser("trainpacked", parents=[common],
                       help="padding-free Llama training steps (DataCollatorWithFlattening) vs sdpa, padded batch")
    p.set_defaults(run=run_trainpacked)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--mlp-ratio", type=int, default=3, help="intermediate_size = ratio x hidden")
    p.add_argument("--seqs", type=ints, default=[16, 64, 1024], metavar="COUNT,SHORTEST,LONGEST",
                   help="COUNT sequence lengths spread geometrically from SHORTEST to LONGEST (default 16,64,1024)")
