"""The CPU subcommands of bench.py: ladder, forward, backward, decode, varlen, logits, masks, tiles.

GFLOP/s count the two matrix products, 4·B·H·(visible query-key pairs)·d (all N² pairs, or N(N+1)/2 under the
causal mask); the backward does 2.5× the forward's work (five products against two), as in the FlashAttention
papers. Softmax is not counted; ours and the peer are charged the same work, so a rate ratio is a time ratio.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from _timing import DTYPES, MATCH_TOLERANCE, Row, max_err, measured_rows, peak_allocator_mib, torch_threads

import cs149gpt
from cs149gpt import _ext

SDPA = "torch sdpa"
# (B, H, N, d); --full adds a small-head shape and (1,32,8192,64).
FORWARD_SHAPES = {"quick": [(1, 8, 512, 64)],
                  "default": [(1, 12, 1024, 64), (4, 12, 2048, 64), (1, 16, 4096, 128)],
                  "full": [(1, 4, 1024, 32), (1, 12, 1024, 64), (4, 12, 2048, 64), (1, 16, 4096, 128),
                           (1, 32, 8192, 64)]}
LADDER_SHAPES = {"quick": [(1, 4, 256, 32)], "default": [(1, 4, 1024, 32), (1, 12, 1024, 64)]}


def shape_str(shape) -> str:
    return "(" + ",".join(str(x) for x in shape) + ")"


def flops(shape, causal: bool) -> float:
    b, h, n, d = shape
    return 4.0 * b * h * (n * (n + 1) // 2 if causal else n * n) * d


def causal_modes(args, default: str) -> list[bool]:
    return {"off": [False], "on": [True], "both": [False, True]}[args.causal or default]


def shapes_for(args, presets: dict) -> list[tuple]:
    if args.shapes:
        return args.shapes
    if args.quick:
        return presets["quick"]
    return presets["full"] if getattr(args, "full", False) and "full" in presets else presets["default"]


def dtypes_for(args, default=("float32",)) -> list[str]:
    return args.dtype or list(default)


def qkv(shape, dtype: str, grad: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(DTYPES[dtype]).requires_grad_(grad) for _ in range(3)]


def progress(text: str) -> None:
    print(f"  {text} ...", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- forward
def forward_rows(shape, causal: bool, dtype: str, threads: int, args, impls=("flash",), bench="forward",
                 peer="sdpa") -> list[Row]:
    q, k, v = qkv(shape, dtype)
    case = f"{shape_str(shape)}{' causal' if causal else ''}"
    progress(f"{bench} {case} {dtype} threads={threads}")
    ours = {impl: (lambda impl=impl: cs149gpt.attention(q, k, v, impl=impl, is_causal=causal)) for impl in impls}
    if peer == "manual":  # the textbook expression, its additive mask built once as a model keeps it in a buffer
        n, scale = shape[2], shape[3] ** -0.5
        mask = torch.full((n, n), float("-inf"), dtype=q.dtype).triu(1) if causal else torch.zeros((), dtype=q.dtype)
        peer_call = ("torch manual", lambda: torch.softmax(q @ k.transpose(-2, -1) * scale + mask, -1) @ v)
    else:
        peer_call = (SDPA, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    rows = measured_rows(bench, case, dtype, threads, ours, peer_call, args, work=flops(shape, causal) / 1e9,
                         unit="GFLOP/s")
    if getattr(args, "memory", False):
        with torch_threads(threads):
            peer_mib = peak_allocator_mib(peer_call[1])
            for row in rows:
                if row.status in ("ok", "wrong"):
                    row.add_note(f"peak MiB ours {peak_allocator_mib(ours[row.ours]):.1f}, peer {peer_mib:.1f}")
    return rows


def run_forward(args) -> list[Row]:
    return [row for shape in shapes_for(args, FORWARD_SHAPES) for dtype in dtypes_for(args)
            for causal in causal_modes(args, "both") for threads in args.threads
            for row in forward_rows(shape, causal, dtype, threads, args, peer=args.peer)]


def run_ladder(args) -> list[Row]:
    """Every rung, naive (N×N scores), blocked (tiled products), fused (a row at a time), flash_teaching, flash, vs SDPA."""
    rows = []
    for shape in shapes_for(args, LADDER_SHAPES):
        for dtype in dtypes_for(args):
            for causal in causal_modes(args, "off"):
                for threads in args.threads:
                    rows += forward_rows(shape, causal, dtype, threads, args, impls=cs149gpt.IMPLS, bench="ladder",
                                         peer=args.peer)
    return rows


# ------------------------------------------------------------------------------------------------- backward
def backward_rows(shape, causal: bool, dtype: str, threads: int, args, phases=("bwd", "fwd+bwd")) -> list[Row]:
    q, k, v = qkv(shape, dtype, grad=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    inputs = (q, k, v)
    attends = {"flash": lambda: cs149gpt.attention(q, k, v, is_causal=causal),
               SDPA: lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    rows = []
    for phase in phases:
        case = f"{phase} {shape_str(shape)}{' causal' if causal else ''}"
        progress(f"backward {case} {dtype} threads={threads}")
        calls = {}
        for name, attend in attends.items():
            if phase == "bwd":  # the backward alone: a forward recorded once, its graph walked again by each call
                out = attend()
                calls[name] = lambda out=out: torch.autograd.grad(out, inputs, dout, retain_graph=True)
            else:
                calls[name] = lambda attend=attend: torch.autograd.grad(attend(), inputs, dout)
        work = flops(shape, causal) * (2.5 if phase == "bwd" else 3.5) / 1e9
        # Gradients are sums over N terms: the match tolerance grows with it.
        tol = 4 * MATCH_TOLERANCE[DTYPES[dtype]] * max(1.0, shape[2] / 1024) ** 0.5
        rows += measured_rows("backward", case, dtype, threads, {"flash": calls["flash"]}, (SDPA, calls[SDPA]), args,
                              work=work, unit="GFLOP/s", tolerance=tol)
        if getattr(args, "memory", False) and phase == "bwd":
            with torch_threads(threads):
                mib = {name: peak_allocator_mib(call) for name, call in calls.items()}
            rows[-1].add_note(f"peak MiB ours {mib['flash']:.1f}, peer {mib[SDPA]:.1f}")
    return rows


def run_backward(args) -> list[Row]:
    return [row for shape in shapes_for(args, FORWARD_SHAPES) for dtype in dtypes_for(args)
            for causal in causal_modes(args, "both") for threads in args.threads
            for row in backward_rows(shape, causal, dtype, threads, args)]


# ------------------------------------------------------------------------------------------------- decode
def decode_rows(batch: int, keys: int, dtype: str, threads: int, args, heads=(32, 8), head_dim=128,
                mask_kind="none", kvcache=True) -> list[Row]:
    """One new query against `keys` cached keys: ours through attention() and attention_with_kvcache() (a cache with
    room for more), against SDPA with enable_gqa. The rate is the GB/s of K and V read."""
    hq, hkv = heads
    g = torch.Generator().manual_seed(0)
    dt = DTYPES[dtype]
    q = torch.randn(batch, hq, 1, head_dim, generator=g).to(dt)
    k, v = (torch.randn(batch, hkv, keys, head_dim, generator=g).to(dt) for _ in range(2))
    k_cache = torch.zeros(batch, hkv, keys + 256, head_dim, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:, :, :keys], v_cache[:, :, :keys] = k, v
    seqlens = torch.full((batch,), keys, dtype=torch.int32)
    mask = None
    if mask_kind != "none":  # a padded batch's key padding: sequence i's first i/(2B) of the keys are padding
        keep = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
        for i in range(batch):
            keep[i, ..., : (i * keys) // (2 * batch)] = False
        mask = keep if mask_kind == "bool" else torch.zeros(keep.shape, dtype=dt).masked_fill(~keep, float("-inf"))
    case = f"B={batch} keys={keys} H={hq}/{hkv} d={head_dim}" + ("" if mask is None else f" mask={mask_kind}")
    progress(f"decode {case} {dtype} threads={threads}")
    ours = {"attention": lambda: cs149gpt.attention(q, k, v, attn_mask=mask)}
    if mask is None and kvcache:
        ours["kvcache"] = lambda: cs149gpt.attention_with_kvcache(q, k_cache, v_cache, seqlens, is_causal=False)
    nbytes = 2 * batch * hkv * keys * head_dim * q.element_size()
    with torch.inference_mode():
        rows = measured_rows("decode", case, dtype, threads, ours,
                             (SDPA, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)),
                             args, work=nbytes / 1e9, unit="GB/s")
        if getattr(args, "bandwidth", False):
            # What reading those bytes costs at best: a float32 buffer of the same size summed with vector loads.
            buffer, probe = torch.ones(nbytes // 4), _ext.load()._testing.read_probe
            rows_probe = measured_rows("decode", case, dtype, threads, {"read probe": lambda: probe(buffer, threads)},
                                       (SDPA, ours["attention"]), args, work=nbytes / 1e9, unit="GB/s",
                                       check=lambda a, b: 0.0)
            for row in rows:
                if row.rate and rows_probe[0].rate:
                    row.add_note(f"{100 * row.rate / rows_probe[0].rate:.0f}% of the read probe's "
                                 f"{rows_probe[0].rate:.1f} GB/s")
    return rows


def run_decode(args) -> list[Row]:
    batches = [1] if args.quick else args.batches
    keys = args.keys or ([512, 2048] if args.quick else [1024, 2048, 4096, 8192])
    return [row for dtype in dtypes_for(args, ("float32", "bfloat16")) for threads in args.threads
            for batch in batches for n in keys
            for row in decode_rows(batch, n, dtype, threads, args, args.heads, args.head_dim, args.mask)]


# ------------------------------------------------------------------------------------------------- masks
def padded_lengths(b: int, n: int) -> list[int]:
    fractions = [1.0, 0.875, 0.625, 0.5, 0.75, 0.375, 0.9375, 0.25]
    return [max(1, int(n * fractions[i % len(fractions)])) for i in range(b)]


def make_mask(case: str, b: int, h: int, n: int) -> torch.Tensor:
    """The masks real models pass: a padded batch's causal prefill (Llama, GPT-2), an encoder's key padding (BERT),
    an ALiBi-style additive bias with -inf above the diagonal."""
    lengths = padded_lengths(b, n)
    if case == "padded causal":  # bool (B, 1, N, N), left padding
        keep = torch.zeros(b, n, dtype=torch.bool)
        for i, length in enumerate(lengths):
            keep[i, n - length:] = True
        return (torch.ones(n, n, dtype=torch.bool).tril()[None] & keep[:, None, :])[:, None]
    if case == "key padding":  # bool (B, 1, 1, N), right padding
        mask = torch.zeros(b, 1, 1, n, dtype=torch.bool)
        for i, length in enumerate(lengths):
            mask[i, ..., :length] = True
        return mask
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)])  # additive bias, float32 (1, H, N, N)
    distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).float()
    return (slopes[:, None, None] * distance[None]).masked_fill(distance[None] > 0, float("-inf"))[None]


MASK_CASES = ("padded causal", "key padding", "additive bias")


def run_masks(args) -> list[Row]:
    shape = args.shapes[0] if args.shapes else (2, 4, 256, 64) if args.quick else (4, 12, 1024, 64)
    rows = []
    for dtype in dtypes_for(args, ("float32", "bfloat16")):
        q, k, v = qkv(shape, dtype)
        for case in MASK_CASES:
            mask = make_mask(case, shape[0], shape[1], shape[2])
            visible = int(mask.expand(shape[0], shape[1], shape[2], shape[2]).ne(
                False if mask.dtype == torch.bool else float("-inf")).sum())
            for threads in args.threads:
                progress(f"masks {case} {dtype} threads={threads}")
                with torch.no_grad():
                    rows += measured_rows("masks", f"{case} {shape_str(shape)}", dtype, threads,
                                          {"flash": lambda: cs149gpt.attention(q, k, v, attn_mask=mask)},
                                          (SDPA, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
                                          args, work=4 * visible * shape[3] / 1e9, unit="GFLOP/s")
    return rows


# ------------------------------------------------------------------------------------------------- varlen
def varlen_lengths(count: int, shortest: int, longest: int) -> list[int]:
    """count lengths spread geometrically from shortest to longest, in a shuffled but fixed order."""
    ratio = (longest / shortest) ** (1.0 / max(count - 1, 1))
    lengths = [round(shortest * ratio ** i) for i in range(count)]
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0)).tolist()
    return [lengths[i] for i in order]


def varlen_rows(lengths, heads: int, head_dim: int, dtype: str, threads: int, args, backward: bool) -> list[Row]:
    """Packed sequences (cs149gpt.varlen_attention, causal) vs the same batch padded to the longest with a padding and
    causal mask: torch SDPA on it (what a CPU user does today) and our own padded call."""
    g = torch.Generator().manual_seed(0)
    total, longest, b = sum(lengths), max(lengths), len(lengths)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    q, k, v = (torch.randn(total, heads, head_dim, generator=g).to(DTYPES[dtype]).requires_grad_(backward)
               for _ in range(3))
    index = torch.cat([torch.arange(n) + i * longest for i, n in enumerate(lengths)])  # packed row -> padded row

    def padded(t):  # (B, H, N, d), zeros past each sequence
        out = t.new_zeros(b * longest, heads, head_dim)
        out = out.index_copy(0, index, t)
        return out.view(b, longest, heads, head_dim).transpose(1, 2)

    keep = torch.zeros(b, longest, dtype=torch.bool)
    for i, n in enumerate(lengths):
        keep[i, :n] = True
    mask = (torch.ones(longest, longest, dtype=torch.bool).tril()[None] & keep[:, None, :])[:, None]
    qp, kp, vp = (padded(t.detach()).requires_grad_(backward) for t in (q, k, v))
    unpad = lambda o: o.transpose(1, 2).reshape(b * longest, heads, head_dim)[index]  # noqa: E731
    calls = {
        "varlen": lambda: cs149gpt.varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=True),
        "flash padded": lambda: unpad(cs149gpt.attention(qp, kp, vp, attn_mask=mask)),
        SDPA + " padded": lambda: unpad(F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)),
    }
    if backward:  # forward and backward; the probe compares dv, on the sequences' rows
        dout = torch.randn(total, heads, head_dim, generator=g).to(DTYPES[dtype])
        calls = {name: (lambda f=f, xs=(q, k, v) if name == "varlen" else (qp, kp, vp):
                        torch.autograd.grad(f(), xs, dout)[2]) for name, f in calls.items()}
        calls = {name: (f if name == "varlen" else lambda f=f: unpad(f())) for name, f in calls.items()}
    phase = "fwd+bwd" if backward else "fwd"
    case = f"{phase} {b} seqs {min(lengths)}..{longest} (H{heads}, d{head_dim}) causal"
    progress(f"varlen {case} {dtype} threads={threads}")
    visible = sum(n * (n + 1) // 2 for n in lengths) * heads
    work = 4 * visible * head_dim * (3.5 if backward else 1.0) / 1e9
    tol = 4 * MATCH_TOLERANCE[DTYPES[dtype]] if backward else None
    peer = SDPA + " padded"
    return measured_rows("varlen", case, dtype, threads, {n: calls[n] for n in ("varlen", "flash padded")},
                         (peer, calls[peer]), args, work=work, unit="GFLOP/s", tolerance=tol)


def run_varlen(args) -> list[Row]:
    lengths = varlen_lengths(8, 32, 512) if args.quick else varlen_lengths(16, 64, 2048)
    return [row for backward in (False, True) for dtype in dtypes_for(args, ("float32", "bfloat16"))
            for threads in args.threads for row in varlen_rows(lengths, 16, 64, dtype, threads, args, backward)]


# ------------------------------------------------------------------------------------------------- logits
def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's slopes, 2^(-8(h+1)/H) for head h (H a power of two, as in the ALiBi paper), float32 (H,)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])


def alibi_bias(slopes: torch.Tensor, n: int, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """The (1, H, N, N) additive mask a torch SDPA user builds for ALiBi: -slope·|i - j|, -inf above the diagonal
    when causal (one tensor: SDPA takes attn_mask or is_causal, not both)."""
    distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).float()  # j - i
    bias = -slopes[:, None, None] * distance.abs()[None]
    if causal:
        bias = bias.masked_fill(distance[None] > 0, float("-inf"))
    return bias[None].to(dtype)


def softcapped_reference(q, k, v, causal: bool, softcap: float) -> torch.Tensor:
    """softmax(softcap·tanh(scale·q kᵀ / softcap) [causal]) v in float32 math: the softcap row's reference."""
    q, k, v = q.float(), k.float(), v.float()
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    s = softcap * torch.tanh(s / softcap)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def logits_rows(shape, causal: bool, dtype: str, threads: int, args) -> list[Row]:
    """softcap and ALiBi slopes in the flash forward against the plain flash forward of the same shape (their
    cost: peer/ours >= 0.91 is <= 10 %), and ALiBi against torch SDPA given the materialised (1, H, N, N) bias
    (built once, outside the timing). The rows against the plain call are checked against the float32 math of
    their own logits, not against the plain output."""
    q, k, v = qkv(shape, dtype)
    heads, n = shape[1], shape[2]
    slopes = alibi_slopes(heads)
    bias = alibi_bias(slopes, n, causal, q.dtype)
    softcap = args.softcap
    case = f"{shape_str(shape)}{' causal' if causal else ''}"
    progress(f"logits {case} {dtype} threads={threads}")
    with torch.no_grad():
        want = {"softcap": softcapped_reference(q, k, v, causal, softcap),
                "alibi": F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                        attn_mask=alibi_bias(slopes, n, causal, torch.float32))}
        calls = {"softcap": lambda: cs149gpt.attention(q, k, v, is_causal=causal, softcap=softcap),
                 "alibi": lambda: cs149gpt.attention(q, k, v, is_causal=causal, alibi_slopes=slopes)}
        plain = ("flash plain", lambda: cs149gpt.attention(q, k, v, is_causal=causal))
        work = flops(shape, causal) / 1e9
        rows = []
        for name, call in calls.items():
            rows += measured_rows("logits", f"{name} {case}", dtype, threads, {name: call}, plain, args, work=work,
                                  unit="GFLOP/s", check=lambda out, _, name=name: max_err(out, want[name]))
        rows += measured_rows("logits", f"alibi {case}", dtype, threads, {"alibi": calls["alibi"]},
                              (SDPA + " + bias", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)),
                              args, work=work, unit="GFLOP/s")
    return rows


def run_logits(args) -> list[Row]:
    shapes = args.shapes or ([(1, 8, 512, 64)] if args.quick else [(1, 16, 2048, 64)])
    return [row for shape in shapes for dtype in dtypes_for(args, ("float32", "bfloat16"))
            for causal in causal_modes(args, "both") for threads in args.threads
            for row in logits_rows(shape, causal, dtype, threads, args)]


# ------------------------------------------------------------------------------------------------- tiles
def run_tiles(args) -> list[Row]:
    """The flash kernel's forward (or backward) under each block_q × block_k, and its default, against SDPA: how the
    defaults in csrc/ are chosen. Which kernel runs is decided by the shape alone; only the tiles change."""
    shapes = args.shapes or ([(1, 4, 512, 64)] if args.quick else [(1, 12, 1024, 64), (1, 16, 4096, 128)])
    block_qs = [32, 64] if args.quick and not args.block_q else args.block_q or [32, 64, 128, 256]
    block_ks = [64, 128] if args.quick and not args.block_k else args.block_k or [64, 128, 256, 512]
    rows = []
    for shape in shapes:
        for dtype in dtypes_for(args):
            for causal in causal_modes(args, "off"):
                for threads in args.threads:
                    q, k, v = qkv(shape, dtype, grad=args.backward)
                    dout = torch.randn_like(q)
                    case = f"{'bwd' if args.backward else 'fwd'} {shape_str(shape)}{' causal' if causal else ''}"
                    progress(f"tiles {case} {dtype} threads={threads}")
                    variants = {"flash default": {}}
                    variants.update({f"flash {bq}x{bk}": dict(block_q=bq, block_k=bk)
                                     for bq in block_qs for bk in block_ks})

                    def call(**tiles):
                        if not args.backward:
                            return lambda: cs149gpt.attention(q, k, v, is_causal=causal, **tiles)
                        out = cs149gpt.attention(q, k, v, is_causal=causal, **tiles)
                        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                    ours = {name: call(**tiles) for name, tiles in variants.items()}
                    if args.backward:
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        peer = (SDPA, lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                        tol = 4 * MATCH_TOLERANCE[DTYPES[dtype]]
                    else:
                        peer = (SDPA, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                        tol = None
                    work = flops(shape, causal) * (2.5 if args.backward else 1.0) / 1e9
                    got = measured_rows("tiles", case, dtype, threads, ours, peer, args, work=work, unit="GFLOP/s",
                                        tolerance=tol)
                    rows += sorted(got, key=lambda r: -(r.ratio or 0))
    return rows


# ------------------------------------------------------------------------------------------------- command line
def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def register(sub, common: argparse.ArgumentParser) -> None:
    def add(name, fn, help_text):
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(run=fn)
        return p

    for name, fn, text in (("ladder", run_ladder, "every rung (naive, blocked, fused, flash_teaching, flash) vs torch"),
                           ("forward", run_forward, "the flash forward vs torch SDPA")):
        p = add(name, fn, text)
        p.add_argument("--peer", choices=("sdpa", "manual"), default="sdpa",
                       help="torch SDPA, or the textbook softmax(q @ kᵀ · scale + mask) @ v")
        p.add_argument("--memory", action="store_true", help="also the peak allocator MiB of one call of each")
        p.add_argument("--full", action="store_true", help="five shapes, up to (1,32,8192,64)")
    p = add("backward", run_backward, "the flash backward (bwd alone, fwd+bwd) vs torch SDPA's")
    p.add_argument("--memory", action="store_true", help="also the peak allocator MiB of one backward of each")
    p = add("decode", run_decode, "one new query against a KV cache (GQA) vs torch SDPA")
    p.add_argument("--batches", type=parse_ints, default=[1, 8])
    p.add_argument("--keys", type=parse_ints, default=None, help="cached keys (default 1024,2048,4096,8192)")
    p.add_argument("--heads", type=parse_ints, default=[32, 8], help="Hq,Hkv (default 32,8: Llama-3-8B)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mask", choices=("none", "bool", "additive"), default="none",
                   help="a (B,1,1,N) key-padding mask for ours and SDPA")
    p.add_argument("--bandwidth", action="store_true", help="also a read-bandwidth probe over the same bytes")
    add("varlen", run_varlen, "packed sequences of mixed lengths vs the batch padded with a mask (torch SDPA, ours)")
    p = add("logits", run_logits, "softcap and ALiBi slopes in the flash forward vs the plain flash forward, and "
            "ALiBi vs torch SDPA given the materialised bias")
    p.add_argument("--softcap", type=float, default=50.0, help="the cap (default 50: Gemma 2's attention softcap)")
    add("masks", run_masks, "the masks real models pass (padded causal, key padding, additive bias) vs torch SDPA")
    p = add("tiles", run_tiles, "the flash kernel under each block_q x block_k, and its default, vs torch SDPA")
    p.add_argument("--block-q", type=parse_ints, default=None)
    p.add_argument("--block-k", type=parse_ints, default=None)
    p.add_argument("--backward", action="store_true", help="time the backward instead of the forward")
