"""Differential fuzzer (slow): cs149gpt.scaled_dot_product_attention and cs149gpt.attention(impl="flash") on random
cases against a float64 reference written from the definition and from README "Non-finite values", with torch's own
SDPA error on the same inputs as the yardstick. Deselected by default (pytest.ini); run it with

    pytest -m slow tests/test_fuzz.py                                  # every ISA x mode, 10 cases each
    CS149GPT_FUZZ_CASES=300 CS149GPT_FUZZ_SEED=1 pytest -m slow tests/test_fuzz.py -k "fwd and avx512"
    CS149GPT_FUZZ_REPLAY=1000017 pytest -m slow tests/test_fuzz.py -k "bwd and avx512-"   # one case again

Modes: fwd (finite inputs, forward), bwd (finite inputs, gradients of q, k, v), nonfinite (NaN/±inf planted in q, k,
v or the mask; forward against the documented rule), nonfinite_bwd (gradients finite wherever float64 autograd of the
rule is). Every case is drawn from its own seed (case seed = seed * 100000 + iteration): a failure names it, and
CS149GPT_FUZZ_REPLAY=<case seed> with the same mode and ISA draws it again.

Rule for a pass (finite modes): ours' max abs error vs float64 <= 2 x torch's own (same dtype, same inputs; when torch
refuses the call, torch on an explicit equivalent mask) + floor x magnitude (|v| max for outputs, |ref grad| max for
gradients), floor 1e-5 (float32), 2e-2 (bfloat16), 2e-3 (float16); NaN/inf patterns must equal the reference's.
Documented deviations are not compared: dropout bits (dropout is not fuzzed), rows whose every visible key carries an
additive offset of finfo.min (README: ours gives 0 there on the base-2 paths), and rows whose every visible key
carries a finite offset <= -1e6 (float32 logits keep q·k to a few ulps of the offset only: any answer is noise).
"""
import math
import os
import random
import sys
import traceback

import pytest
import torch

import cs149gpt
from tests._helpers import isa, module  # noqa: F401  (isa: fixture)

CASES = int(os.environ.get("CS149GPT_FUZZ_CASES", "10"))
SEED = int(os.environ.get("CS149GPT_FUZZ_SEED", "0"))
REPLAY = os.environ.get("CS149GPT_FUZZ_REPLAY")
MAX_WORK = 6e7  # cap on B*Hq*Nq*Nk*d per case
MODES = ("fwd", "bwd", "nonfinite", "nonfinite_bwd")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
EDGE_N = (1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129, 191, 192, 193, 255, 256, 257,
          300, 383, 384, 385, 511, 512, 513, 700)
EDGE_D = (1, 2, 3, 4, 5, 8, 16, 17, 31, 32, 33, 48, 63, 64, 65, 72, 80, 96, 100, 112, 127, 128, 129, 130, 160)
FLOOR = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
NAT = {"float32": 2.0 ** -18, "bfloat16": 2.0 ** -9, "float16": 2.0 ** -12}

_torch_sdpa = torch.nn.functional.scaled_dot_product_attention
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INF = math.inf


# ----------------------------------------------------------------------------------------------------- case drawing
def draw_case(cs, mode, dtypes, api):
    r = random.Random(cs)
    c = {"seed": cs}
    c["dtype"] = r.choice(dtypes)
    c["api"] = r.choice(("sdpa", "attn")) if api == "both" else api
    c["ndim"] = r.choice((3, 4, 4, 4)) if c["api"] == "sdpa" else r.choice((2, 3, 4, 4, 4))
    c["B"] = r.choice((1, 1, 2, 3)) if c["ndim"] == 4 else 1
    hkv = r.choice((1, 1, 2, 3))
    g = r.choice((1, 1, 2, 3, 6))
    if hkv * g > 6:
        g = 1
    c["gqa"] = g > 1
    if c["ndim"] == 2:
        hkv, g = 1, 1
        c["gqa"] = False
    c["Hkv"], c["Hq"] = hkv, hkv * g

    def pick_n():
        u = r.random()
        if u < 0.55:
            return r.choice(EDGE_N)
        if u < 0.7:
            return 1
        return r.randint(1, 700)
    c["Nq"], c["Nk"] = pick_n(), pick_n()
    if r.random() < 0.25:
        c["Nk"] = c["Nq"]
    c["d"] = r.choice(EDGE_D) if r.random() < 0.8 else r.randint(1, 160)
    # keep each case modest
    bh = c["B"] * c["Hq"]
    while bh * c["Nq"] * c["Nk"] * max(c["d"], 16) > MAX_WORK * (0.25 if mode.endswith("bwd") else 1.0):
        if c["Nq"] >= c["Nk"] and c["Nq"] > 1:
            c["Nq"] = max(1, c["Nq"] // 2 + r.choice((-1, 0, 1)))
        elif c["Nk"] > 1:
            c["Nk"] = max(1, c["Nk"] // 2 + r.choice((-1, 0, 1)))
        else:
            break
    lay_q = ("contig", "contig", "bnhd", "seqstride", "dpad", "dlast", "offset")
    lay_kv = lay_q + ("expand_b", "expand_h", "expand_n")
    c["lq"] = r.choice(lay_q)
    c["lk"] = r.choice(lay_kv)
    c["lv"] = c["lk"] if r.random() < 0.6 else r.choice(lay_kv)
    if c["api"] == "sdpa":
        c["causal"] = r.random() < 0.4
    else:
        c["causal"] = r.choice((False, False, True, "top_left", "bottom_right"))
        c["window"] = None
        if r.random() < 0.3:
            def wb():
                return r.choice((-1, 0, 1, 2, 5, 31, 32, 64, 100, 127, 128, 255, 1000, sys.maxsize))
            c["window"] = (wb(), wb())
        c["block_q"] = r.choice((None,) * 6 + (1, 3, 16, 31, 64, 100, 1024))
        c["block_k"] = r.choice((None,) * 6 + (1, 5, 16, 33, 64, 256, 1024))
        c["lse"] = r.random() < 0.3
    c["scale"] = r.choice((None,) * 5 + (1.0, 0.5, 0.01, 2.0, -0.7, 0.0, 1e-6, 3.0))
    c["qmul"] = r.choice((1.0, 1.0, 1.0, 0.1, 3.0, 8.0))
    c["vmul"] = r.choice((1.0, 1.0, 0.01, 10.0))
    # mask
    c["mask"] = None
    if r.random() < 0.6:
        kinds = ("bool", "float32", "qdtype")
        m = {"kind": r.choice(kinds)}
        if c["ndim"] == 4:
            shapes = ("NqNk", "11NqNk", "B11Nk", "B1NqNk", "1HNqNk", "BHNqNk", "Nk", "1Nk", "BH1Nk", "Nq1", "HNqNk")
        elif c["ndim"] == 3:
            shapes = ("NqNk", "1NqNk", "HNqNk", "H1Nk", "Nk", "Nq1")
        else:
            shapes = ("NqNk", "Nk", "Nq1")
        m["shape"] = r.choice(shapes)
        m["pattern"] = r.choice(("random", "keypad", "keypad_left", "band", "rowhide", "allhide", "allshow",
                                 "causal_like"))
        m["p"] = r.choice((0.95, 0.5, 0.1))
        m["hidden_val"] = r.choice(("-inf", "-inf", "-1e4", "-1e9", "-1e30", "finfo_min"))
        m["shown_val"] = r.choice(("zero", "zero", "randn", "randn_big"))
        m["noncontig"] = r.choice((False, False, "transpose", "slice"))
        c["mask"] = m
    if mode in ("nonfinite", "nonfinite_bwd"):
        if mode == "nonfinite_bwd":  # (before the places are drawn: a dropped mask takes none)
            c["mask"] = c["mask"] if r.random() < 0.5 else None
        places = []
        for _ in range(r.choice((1, 1, 2, 3, 5))):
            places.append((r.choice("qkv" + ("m" if c["mask"] and c["mask"]["kind"] != "bool" else "")),
                           r.random(), r.choice(("nan", "inf", "-inf"))))
        c["nonfinite"] = places
    c["check_threads"] = r.random() < 0.15
    c["bwd_path"] = r.choice(("auto",) * 5 + ("one_pass", "two_pass", "one_pass_chunked")) if mode.endswith(
        "bwd") else "auto"
    return c


# ------------------------------------------------------------------------------------------------- tensor building
def logical_shape(c, which):
    n = c["Nq"] if which == "q" else c["Nk"]
    h = c["Hq"] if which == "q" else c["Hkv"]
    if c["ndim"] == 4:
        return (c["B"], h, n, c["d"])
    if c["ndim"] == 3:
        return (h, n, c["d"])
    return (n, c["d"])


def make(c, which, layout, g, mul):
    shape = logical_shape(c, which)
    dt = DT[c["dtype"]]
    nd = len(shape)

    def rnd(*s):
        return (torch.randn(*s, generator=g) * mul).to(dt)
    if layout == "bnhd" and nd >= 3:
        s = list(shape)
        s[-3], s[-2] = s[-2], s[-3]
        return rnd(*s).transpose(-3, -2)
    if layout == "seqstride":
        s = list(shape)
        s[-2] *= 2
        return rnd(*s)[..., ::2, :]
    if layout == "dpad":
        s = list(shape)
        s[-1] += 5
        return rnd(*s)[..., 3:3 + shape[-1]]
    if layout == "dlast":
        s = list(shape)
        s[-1], s[-2] = s[-2], s[-1]
        return rnd(*s).transpose(-1, -2)
    if layout == "offset":
        n = math.prod(shape)
        return rnd(n + 13)[13:].view(shape)
    if layout == "expand_b" and nd == 4:
        s = list(shape)
        s[0] = 1
        return rnd(*s).expand(shape)
    if layout == "expand_h" and nd >= 3:
        s = list(shape)
        s[-3] = 1
        return rnd(*s).expand(shape)
    if layout == "expand_n":
        s = list(shape)
        s[-2] = 1
        return rnd(*s).expand(shape)
    return rnd(*shape)


MASK_SHAPES = {
    "NqNk": lambda c: (c["Nq"], c["Nk"]), "11NqNk": lambda c: (1, 1, c["Nq"], c["Nk"]),
    "B11Nk": lambda c: (c["B"], 1, 1, c["Nk"]), "B1NqNk": lambda c: (c["B"], 1, c["Nq"], c["Nk"]),
    "1HNqNk": lambda c: (1, c["Hq"], c["Nq"], c["Nk"]), "BHNqNk": lambda c: (c["B"], c["Hq"], c["Nq"], c["Nk"]),
    "Nk": lambda c: (c["Nk"],), "1Nk": lambda c: (1, c["Nk"]), "BH1Nk": lambda c: (c["B"], c["Hq"], 1, c["Nk"]),
    "Nq1": lambda c: (c["Nq"], 1), "HNqNk": lambda c: (c["Hq"], c["Nq"], c["Nk"]),
    "1NqNk": lambda c: (1, c["Nq"], c["Nk"]), "H1Nk": lambda c: (c["Hq"], 1, c["Nk"]),
}


def make_mask(c, g):
    """(mask tensor as passed, visible bool at mask shape, additive float64 at mask shape or None)."""
    m = c["mask"]
    shape = MASK_SHAPES[m["shape"]](c)
    nq, nk = (shape[-2] if len(shape) >= 2 else 1), shape[-1]
    lead = shape[:-2] if len(shape) >= 2 else ()
    full = (*lead, nq, nk)
    u = torch.rand(full, generator=g)
    pat = m["pattern"]
    jj = torch.arange(nk).view(1, nk)
    ii = torch.arange(nq).view(nq, 1)
    if pat == "random":
        vis = u < m["p"]
    elif pat in ("keypad", "keypad_left"):
        L = torch.randint(0, nk + 1, (*lead, 1, 1), generator=g)
        vis = (jj < L) if pat == "keypad" else (jj >= nk - L)
        vis = vis.expand(full)
    elif pat == "band":
        lo = torch.randint(0, nk + 1, (*lead, nq, 1), generator=g)
        w = torch.randint(0, nk + 1, (*lead, nq, 1), generator=g)
        vis = (jj >= lo) & (jj < lo + w)
    elif pat == "rowhide":
        vis = (u < m["p"]) & (torch.rand((*lead, nq, 1), generator=g) < 0.6)
    elif pat == "allhide":
        vis = torch.zeros(full, dtype=torch.bool)
    elif pat == "allshow":
        vis = torch.ones(full, dtype=torch.bool)
    else:  # causal_like with a random offset
        off = int(torch.randint(-3, 4, (1,), generator=g))
        vis = (jj <= ii + off).expand(full)
    vis = vis.reshape(shape).contiguous()
    qdt = DT[c["dtype"]]
    if m["kind"] == "bool":
        t, add = vis.clone(), None
    else:
        mdt = torch.float32 if m["kind"] == "float32" else qdt
        hv = {"-inf": -INF, "-1e4": -1e4, "-1e9": -1e9, "-1e30": -1e30,
              "finfo_min": torch.finfo(mdt).min}[m["hidden_val"]]
        if mdt == torch.float16 and hv in (-1e9, -1e30):
            hv = -6e4
        if mdt == torch.bfloat16 and hv == -1e30:
            hv = -1e30
        shown = {"zero": torch.zeros(shape), "randn": torch.randn(shape, generator=g),
                 "randn_big": torch.randn(shape, generator=g) * 20}[m["shown_val"]]
        tf = torch.where(vis, shown, torch.tensor(hv, dtype=torch.float32))
        t = tf.to(mdt)
        add = t.double()
    if m["noncontig"] == "transpose" and t.dim() >= 2:
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif m["noncontig"] == "slice":
        big = torch.zeros((*t.shape[:-1], t.shape[-1] * 2 + 1), dtype=t.dtype)
        big[..., 1::2] = t
        t = big[..., 1::2]
    if add is None:
        vis_eff = t.clone()
    else:
        vis_eff = t.double() > -INF
        add = t.double()
    return t, vis_eff, add


def causal_window_visible(c):
    nq, nk = c["Nq"], c["Nk"]
    i = torch.arange(nq).view(nq, 1)
    j = torch.arange(nk).view(1, nk)
    vis = torch.ones(nq, nk, dtype=torch.bool)
    cz = c["causal"]
    if cz is True or cz == "top_left":
        vis &= j <= i
    elif cz == "bottom_right":
        vis &= j <= i + nk - nq
    w = c.get("window")
    if w is not None:
        left, right = w
        if left != -1 and left <= nq + nk:
            vis &= j >= i + nk - nq - left
        if right != -1 and right <= nq + nk:
            vis &= j <= i + nk - nq + right
    return vis


def plant(t, frac, val):
    """Writes val at a position of t chosen by frac (in place on t's memory through its view)."""
    idx = []
    f = frac
    for s in t.shape:
        f *= s
        k = min(int(f), s - 1)
        idx.append(k)
        f -= k
    with torch.no_grad():
        t[tuple(idx)] = float(val)
    return tuple(idx)


# ------------------------------------------------------------------------------------------------------ reference
def expand_heads(c, t):
    if c["ndim"] >= 3 and c["Hq"] != c["Hkv"]:
        return t.repeat_interleave(c["Hq"] // c["Hkv"], dim=-3)
    return t


def ref_forward(c, q, k, v, vis, add, scale):
    """float64 under README's rule; vis: bool broadcastable to scores (hidden keys never read); add: float64 or None.
    Differentiable (finite modes). Returns out, lse, p (and the weights)."""
    k = expand_heads(c, k)
    v = expand_heads(c, v)
    s = (q @ k.transpose(-1, -2)) * scale
    if add is not None:
        s = s + torch.where(vis, add, torch.zeros((), dtype=torch.float64))
    vis = vis.expand(s.shape)
    s = s.masked_fill(~vis, -INF)
    m = s.amax(-1, keepdim=True)
    no_weight = m == -INF
    m_safe = m.masked_fill(no_weight, 0.0).detach()
    p = torch.exp(s - m_safe)
    l = p.sum(-1, keepdim=True)
    p = torch.where(l == 0, torch.zeros((), dtype=torch.float64), p / torch.where(l == 0, 1.0, l))
    vfin = torch.where(torch.isfinite(v), v, torch.zeros((), dtype=torch.float64))
    out = p @ vfin
    bad = ~torch.isfinite(v)
    if bad.any():  # IEEE Σ p_j v_j over visible keys for the non-finite value entries (also at p_j = 0)
        out = out.clone()
        for idx in bad.nonzero().tolist():
            *lead, j, col = idx
            vj = v[tuple(lead + [j, col])]
            contrib = p[tuple(lead)][..., :, j] * vj  # (Nq,)
            seen = vis[tuple(lead)][..., :, j]
            contrib = torch.where(seen, contrib, torch.zeros((), dtype=torch.float64))
            # rows that see no key, or whose logits are all −inf, get 0 (README table) — leave those
            nw = no_weight[tuple(lead)][..., :, 0]
            contrib = torch.where(nw, torch.zeros((), dtype=torch.float64), contrib)
            sel = out[tuple(lead)]
            sel[..., :, col] = sel[..., :, col] + contrib
    lse = torch.where(l == 0, -INF, m_safe + torch.log(l)).squeeze(-1)
    return out, lse, p, vis, s


def full_vis_add(c, mask_vis, mask_add):
    vis = causal_window_visible(c)
    return (vis if mask_vis is None else vis & mask_vis), mask_add


# ------------------------------------------------------------------------------------------------------ comparing
def maxerr(a, b):
    """max |a - b| where both finite."""
    a = a.double()
    b = b.double()
    f = torch.isfinite(a) & torch.isfinite(b)
    if not f.any():
        return 0.0
    return (a[f] - b[f]).abs().max().item()


def where_differ(where, got, want):
    """The first three positions where `where` is true, with ours' and the reference's values there."""
    w = where.nonzero()[:3].tolist()
    return f"at {w} (ours {[got[tuple(x)].item() for x in w]}, ref {[want[tuple(x)].item() for x in w]})"


def pattern_diff(got, want, skip=None):
    got = got.double()
    msgs = []
    gn, wn = got.isnan(), want.isnan()
    diff = gn != wn
    if skip is not None:
        diff &= ~skip
    if diff.any():
        msgs.append(f"NaN pattern: ours NaN {int(gn.sum())} ref NaN {int(wn.sum())} differ "
                    + where_differ(diff, got, want))
    gi = got.isinf() | want.isinf()
    if skip is not None:
        gi &= ~skip
    if gi.any() and not torch.equal(got[gi & ~gn & ~wn], want[gi & ~gn & ~wn]):
        msgs.append("inf pattern differs " + where_differ(gi & ~gn & ~wn & (got != want), got, want))
    return msgs


def describe(c):
    keys = ("api", "dtype", "ndim", "B", "Hq", "Hkv", "Nq", "Nk", "d", "lq", "lk", "lv", "causal", "window", "block_q",
            "block_k", "scale", "qmul", "vmul", "mask", "nonfinite", "bwd_path", "lse", "check_threads")
    return {k: c[k] for k in keys if k in c}


# -------------------------------------------------------------------------------------------------------- one case
def run_case(c, mode):
    g = torch.Generator().manual_seed(c["seed"])
    q = make(c, "q", c["lq"], g, c["qmul"])
    k = make(c, "k", c["lk"], g, 1.0)
    v = make(c, "v", c["lv"], g, c["vmul"])
    mask_t, mask_vis, mask_add = (None, None, None)
    if c["mask"] is not None:
        mask_t, mask_vis, mask_add = make_mask(c, g)
    planted = []
    if mode.startswith("nonfinite"):
        # plant into the base memory (an expanded view shares it: every alias gets the value, as in reality)
        for which, frac, val in c["nonfinite"]:
            t = {"q": q, "k": k, "v": v, "m": mask_t}[which]
            if which != "m" and t.stride().count(0):
                base = t
                # write into the underlying storage through an un-expanded view
                sl = tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())
                base = t[sl]
                idx = plant(base, frac, val)
            else:
                idx = plant(t, frac, val)
            planted.append((which, idx, val))
        if mask_t is not None and mask_add is not None:
            mask_vis = mask_t.double() > -INF
            mask_vis = mask_vis | mask_t.double().isnan()
            mask_add = mask_t.double()
    d = c["d"]
    scale = c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(d)
    vis, add = full_vis_add(c, mask_vis, mask_add)
    if add is not None:
        add = add.masked_fill(~(add > -INF) & ~add.isnan(), 0.0)  # −inf entries are in vis already

    need_grad = mode.endswith("bwd")
    qd, kd, vd = (t.detach().double().requires_grad_(need_grad) for t in (q, k, v))
    ref_out, ref_lse, ref_p, vis_full, ref_s = ref_forward(c, qd, kd, vd, vis, add, scale)

    # rows documented as deviating: every visible key has an additive offset at finfo.min (README)
    skip_rows = None
    if add is not None:
        huge = add <= -2e38
        vis_e = vis_full
        covered = (~vis_e | huge.expand(vis_e.shape)).all(-1) & vis_e.any(-1)
        if covered.any():
            skip_rows = covered
    # ill-conditioned rows: every visible key carries a finite additive offset <= -1e6, so
    # float32 logits keep q·k to a few ulps of the offset only (ulp(1e9) = 64): any float32 answer is noise there
    if add is not None:
        a_vis = torch.where(vis_full, add.expand(vis_full.shape), torch.tensor(-INF, dtype=torch.float64))
        a_vis = torch.where(a_vis.isnan(), torch.tensor(0.0, dtype=torch.float64), a_vis)
        uni = (a_vis.amax(-1) <= -1e6) & vis_full.any(-1)
        if uni.any():
            skip_rows = uni if skip_rows is None else (skip_rows | uni)
    # rows where the documented table is ambiguous: all visible logits −inf AND a visible key with non-finite v
    # (ref gives 0), and nonfinite v at weight < 2^-120 (ours flushes that weight to exactly 0)
    skip = None
    if skip_rows is not None:
        skip = skip_rows[..., None].expand(ref_out.shape).clone()
    if mode.startswith("nonfinite"):
        vv = expand_heads(c, vd.detach())
        badv = ~torch.isfinite(vv)
        if badv.any():
            tiny = (ref_p.detach() > 0) & (ref_p.detach() < 2.0 ** -100) & vis_full
            # (…, Nq, Nk) x (…, Nk, d) -> rows, cols touched by a tiny weight on a non-finite value
            touched = (tiny.double() @ badv.double()) > 0
            # README's table is ambiguous for a row whose visible logits are all −inf (row "→ 0") and that sees a
            # non-finite value (row "Σ p_j v_j in IEEE, also at p_j = 0" → NaN): both answers are accepted
            s_vis = torch.where(vis_full, ref_s.detach(), torch.tensor(-INF, dtype=torch.float64))
            all_ninf = (s_vis.amax(-1, keepdim=True) == -INF) & vis_full.any(-1, keepdim=True)
            touched |= all_ninf & ((vis_full.double() @ badv.double()) > 0)
            # bf16/fp16 outputs: P rounded; a small p (< 2^-24 for fp16 subnormals) may differ: also skip
            skip = touched if skip is None else (skip | touched)
    # ------------------------------------------------------------------------------------------------- ours
    torch_kwargs = {}
    if c["api"] == "sdpa":
        kwargs = dict(attn_mask=mask_t, is_causal=c["causal"], scale=c["scale"], enable_gqa=c["gqa"])
        ours_fn = lambda q_, k_, v_: cs149gpt.scaled_dot_product_attention(q_, k_, v_, **kwargs)  # noqa: E731
        torch_kwargs = kwargs
        torch_same_call = True
    else:
        kwargs = dict(impl="flash", scale=c["scale"], is_causal=c["causal"], block_q=c["block_q"],
                      block_k=c["block_k"], attn_mask=mask_t, window=c["window"], return_lse=c["lse"])
        ours_fn = lambda q_, k_, v_: cs149gpt.attention(q_, k_, v_, **kwargs)  # noqa: E731
        torch_same_call = False
    # torch on the same call, or on an equivalent explicit mask
    if torch_same_call:
        tq_kwargs = torch_kwargs
    elif mask_t is None and c.get("window") is None and (c["causal"] in (False, True, "top_left") or c["Nq"] == c["Nk"]):
        tq_kwargs = dict(is_causal=bool(c["causal"]), scale=c["scale"], enable_gqa=c["gqa"])
    else:
        cw = causal_window_visible(c)
        if mask_t is None:
            tm = cw
        elif mask_t.dtype == torch.bool:
            tm = mask_t & cw
        else:
            tm = mask_t.masked_fill(~cw, -INF)
        tq_kwargs = dict(attn_mask=tm, is_causal=False, scale=c["scale"], enable_gqa=c["gqa"])
    fails = []
    used = None
    if c["api"] == "sdpa":
        try:
            used = cs149gpt.uses_our_kernel(q, k, v, mask_t, 0.0, c["causal"], c["scale"], c["gqa"])
        except Exception as e:  # noqa: BLE001
            fails.append(f"uses_our_kernel raised {type(e).__name__}: {e}")
    leaves = None
    if need_grad:
        qs, ks, vs = (rebuild_view(t) for t in (q, k, v))
    else:
        qs, ks, vs = q, k, v
    try:
        res = ours_fn(qs, ks, vs)
    except Exception as e:  # noqa: BLE001
        tr = None
        try:
            _torch_sdpa(q, k, v, **tq_kwargs)
            tr = "torch takes it"
        except Exception as e2:  # noqa: BLE001
            tr = f"torch raises {type(e2).__name__}"
        return [f"ours raised {type(e).__name__}: {str(e)[:200]} ({tr})"]
    out, lse = (res if isinstance(res, tuple) else (res, None))
    if out.shape != q.shape or out.dtype != q.dtype:
        fails.append(f"out shape/dtype {tuple(out.shape)} {out.dtype}")
        return fails
    # torch's baseline (same dtype), same call if it takes it
    t_out, t_err_note = None, ""
    try:
        if need_grad:
            tq, tk, tv = (rebuild_view(t) for t in (q, k, v))
        else:
            tq, tk, tv = q, k, v
        try:
            t_out = _torch_sdpa(tq, tk, tv, **tq_kwargs)
        except Exception as e:  # noqa: BLE001
            if c["api"] == "sdpa":
                t_err_note = f"torch refuses ({type(e).__name__}: {str(e)[:80]})"
                cw = causal_window_visible(c) if c["causal"] else None
                tm = mask_t
                if cw is not None:
                    tm = (mask_t & cw) if mask_t.dtype == torch.bool else mask_t.masked_fill(~cw, -INF)
                t_out = _torch_sdpa(tq, tk, tv, attn_mask=tm, scale=c["scale"], enable_gqa=c["gqa"])
            else:
                raise
    except Exception as e:  # noqa: BLE001
        t_err_note = f"torch baseline failed: {type(e).__name__}: {str(e)[:100]}"
        t_out = None
    # magnitudes
    vfin = vd.detach()[torch.isfinite(vd.detach())]
    mag = vfin.abs().max().item() if vfin.numel() else 1.0
    fl = FLOOR[c["dtype"]]
    e_ours = maxerr(out, ref_out.detach() if skip is None else torch.where(skip, out.double(), ref_out.detach()))
    e_torch = maxerr(t_out, ref_out.detach()) if t_out is not None else None
    if skip is not None and t_out is not None:
        e_torch = maxerr(t_out, torch.where(skip, t_out.double(), ref_out.detach()))
    # a second yardstick: the same definition computed naively in float32 (logits rounded as float32 rounds them,
    # e.g. a -1e9 offset swallowing q·k), output rounded to q's dtype; torch's SDPA is NaN or refuses on some calls
    with torch.no_grad():
        nv = ref_forward(c, q.detach().float(), k.detach().float(), v.detach().float(), vis,
                         add.float() if add is not None else None, scale)[0].to(q.dtype)
    e_naive = maxerr(nv, ref_out.detach() if skip is None else torch.where(skip, nv.double(), ref_out.detach()))
    e_base = max(e_torch or 0.0, e_naive)
    # float32 logit rounding: an error of eps·Σ|scale·q_t·k_t| (+|finite mask offset|) in a logit moves the output by
    # about that times |v|: with large logits (peaky softmax) max-abs errors are noisy, torch's and ours alike
    with torch.no_grad():
        a = (qd.detach().abs().nan_to_num(0, 0, 0) @ expand_heads(c, kd.detach().abs().nan_to_num(0, 0, 0))
             .transpose(-1, -2)) * abs(scale)
        if add is not None:
            a = a + add.abs().nan_to_num(0, 0, 0).clamp(max=1e4)
        a_max = a.max().item() if a.numel() else 0.0
    tol = 2 * e_base + fl * mag + 2.0 ** -24 * a_max * mag + (2.0 ** -24 if c["dtype"] == "float16" else 0.0)
    pd = pattern_diff(out, ref_out.detach(), skip)
    for p in pd:
        fails.append("forward " + p)
    if not e_ours <= tol:
        fails.append(f"forward max abs err {e_ours:.3g} > tol {tol:.3g} (torch err {e_torch}, naive f32 err {e_naive:.3g}, mag {mag:.3g}) "
                     f"{t_err_note}")
    if lse is not None:
        rl = ref_lse.detach()
        lp = pattern_diff(lse, rl, skip_rows)
        fails += ["lse " + p for p in lp]
        fin = torch.isfinite(rl) & torch.isfinite(lse.double())
        if skip_rows is not None:
            fin &= ~skip_rows
        if fin.any():
            el = (lse.double()[fin] - rl[fin]).abs().max().item()
            ltol = 1e-4 * max(1.0, rl[fin].abs().max().item()) * (1 if c["dtype"] == "float32" else 10)
            if el > ltol:
                fails.append(f"lse err {el:.3g} > {ltol:.3g}")
    if c.get("check_threads") and not need_grad:
        nt = torch.get_num_threads()
        torch.set_num_threads(1 if nt > 1 else 2)
        try:
            res2 = ours_fn(qs, ks, vs)
        finally:
            torch.set_num_threads(nt)
        out2 = res2[0] if isinstance(res2, tuple) else res2
        if not torch.equal(out2.view(-1).view(torch.int16 if out2.element_size() == 2 else torch.int32)
                           if out2.is_contiguous() and out.is_contiguous() else out2.nan_to_num(7.0),
                           out.view(-1).view(torch.int16 if out.element_size() == 2 else torch.int32)
                           if out2.is_contiguous() and out.is_contiguous() else out.nan_to_num(7.0)):
            fails.append("results differ between thread counts")
    info = {"e_ours": e_ours, "e_torch": e_base, "used": used}
    if need_grad and not fails:
        gout = torch.randn(out.shape, generator=g).to(out.dtype)
        try:
            gq = torch.autograd.grad(out, (qs, ks, vs), gout)
        except Exception as e:  # noqa: BLE001
            return fails + [f"ours backward raised {type(e).__name__}: {str(e)[:200]}"]
        rg = torch.autograd.grad(ref_out, (qd, kd, vd), gout.double())
        # naive float32 autograd of the same definition: a yardstick where float32 logits are ill-conditioned
        qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
        nf = ref_forward(c, qf, kf, vf, vis, add.float() if add is not None else None, scale)[0].to(q.dtype)
        ng = torch.autograd.grad(nf, (qf, kf, vf), gout, allow_unused=True)
        tg = None
        if t_out is not None:
            try:
                tg = torch.autograd.grad(t_out, (tq, tk, tv), gout)
            except Exception as e:  # noqa: BLE001
                t_err_note += f" torch backward raised {type(e).__name__}"
        # rows left out of the gradient comparison: README's finfo.min rows, and rows whose
        # every visible key carries a finite additive offset <= -1e6: there float32's lse = offset + log Σ loses the
        # log Σ and the flash backward's P = exp(s - lse) is off (torch's flash backward does the same)
        gskip_rows = skip_rows
        if add is not None:
            a_vis = torch.where(vis_full, add.expand(vis_full.shape), torch.tensor(-INF, dtype=torch.float64))
            uni = (a_vis.amax(-1) <= -1e6) & vis_full.any(-1)
            if uni.any():
                gskip_rows = uni if gskip_rows is None else (gskip_rows | uni)
        for name, a, b, tt, nn in zip("qkv", gq, rg, tg if tg is not None else (None,) * 3, ng):
            b = b.detach()
            gskip = None
            if name == "q" and gskip_rows is not None:
                gskip = gskip_rows[..., None].expand(b.shape) if b.shape[:-1] == gskip_rows.shape else None
            if gskip_rows is not None and gskip is None:
                continue  # skipped rows reach k/v grads: skip
            if mode == "nonfinite_bwd":
                # README: wherever float64 autograd of the rule is finite, ours is finite and agrees
                badg = torch.isfinite(b) & ~torch.isfinite(a.double())
                if gskip is not None:
                    badg &= ~gskip
                if badg.any():
                    fails.append(f"grad {name} non-finite where float64 autograd is finite "
                                 + where_differ(badg, a, b))
                nonfin = ~torch.isfinite(b)
                gskip = nonfin if gskip is None else (gskip | nonfin)
            else:
                for p in pattern_diff(a, b, gskip):
                    fails.append(f"grad {name} " + p)
            bb = b.nan_to_num(0, 0, 0)
            if gskip is not None:
                a = torch.where(gskip, bb.to(a.dtype), a)
                tt = torch.where(gskip, bb.to(tt.dtype), tt) if tt is not None else None
                nn = torch.where(gskip, bb.to(nn.dtype), nn) if nn is not None else None
            bf = bb[torch.isfinite(b)]
            gm = bf.abs().max().item() if bf.numel() else 1.0
            ea = maxerr(a, bb)
            et = maxerr(tt, bb) if tt is not None else None
            en = maxerr(nn, bb) if nn is not None else 0.0
            # natural magnitude of the gradient's rounding noise (flash backward: D = rowsum(dO∘O) from the rounded
            # output, P recomputed from lse): |scale|·|dO|·|v|·sqrt(d)·|k| for dq, ·|q|·sqrt(Nq) for dk, |dO|·sqrt(Nq) for dv
            dO = gout.double().abs().max().item()
            vmax = float(vd.detach().nan_to_num(0, 0, 0).abs().max())
            qmax = float(qd.detach().nan_to_num(0, 0, 0).abs().max())
            kmax = float(kd.detach().nan_to_num(0, 0, 0).abs().max())
            base_nat = abs(scale) * dO * vmax * math.sqrt(c["d"])
            nat = {"q": base_nat * kmax, "k": base_nat * qmax * math.sqrt(c["Nq"]), "v": dO * math.sqrt(c["Nq"])}[name]
            gtol = (2 * max(et or 0.0, en) + fl * max(gm, 1e-30) * 2 + 2.0 ** -24 * a_max * gm * 2
                    + NAT[c["dtype"]] * nat + (2.0 ** -24 if c["dtype"] == "float16" else 0.0))
            if not ea <= gtol:
                fails.append(f"grad {name} max abs err {ea:.3g} > tol {gtol:.3g} (torch err {et}, naive f32 err "
                             f"{en:.3g}, |ref| {gm:.3g}) {t_err_note}")
    return fails, info


def rebuild_view(t, leaf=None):
    """The view t rebuilt, same sizes, strides and storage offset, on a grad-requiring copy of its base."""
    base = t._base if t._base is not None else t
    lf = base.detach().clone().requires_grad_(True)
    assert lf.is_contiguous() and base.is_contiguous() and base.storage_offset() == 0
    return lf.as_strided(t.size(), t.stride(), t.storage_offset())


def set_backward_path(m, path):
    m._testing.set_backward_path(path if path in ("auto", "two_pass") else "one_pass")
    m._testing.set_backward_key_chunks(3 if path == "one_pass_chunked" else 0)
    m._testing.set_backward_head_parts({"one_pass_chunked": 2, "auto": 0}.get(path, 1))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_fuzz(mode, isa, restore_threads, request):  # noqa: F811  (isa: fixture)
    torch.set_num_threads(2)
    m = module()
    seeds = [int(REPLAY)] if REPLAY else [SEED * 100000 + i for i in range(CASES)]
    failures = []
    try:
        for cs in seeds:
            c = draw_case(cs, mode, DTYPE_NAMES, "both")
            if mode.endswith("bwd"):
                set_backward_path(m, c["bwd_path"])
            try:
                r = run_case(c, mode)
            except Exception:  # noqa: BLE001
                r = ([f"fuzzer/ref exception: {traceback.format_exc(limit=3)[-400:]}"], {})
            fails = r[0] if isinstance(r, tuple) else r
            if fails:
                failures.append(f"case seed {cs} ({c['dtype']}, {c['api']}): " + "; ".join(fails)
                                + f"\n  case {describe(c)}\n  again: CS149GPT_FUZZ_REPLAY={cs} pytest -m slow "
                                f"'{request.node.nodeid}'")
    finally:
        set_backward_path(m, "auto")
    assert not failures, f"{len(failures)} of {len(seeds)} cases fail:\n" + "\n".join(failures[:10])
