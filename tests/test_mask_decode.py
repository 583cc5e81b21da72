"""attn_mask and the sliding window on the decode kernel (flash_decode.cpp): calls with a few query rows (Nq <= 16,
the tokens being generated) and a mask run flash-decoding, not the tiled flash kernel, against the float64 reference
of test_masks.py (softmax(scale · q kᵀ + M) v; rows that see no key: out 0, lse −inf, as torch's SDPA).

Covered: every broadcast shape of bool and additive masks (float32 and the input dtype) with each causal mode, GQA,
float32/bf16/fp16 and every ISA; key-padding masks (left and right, bool, −inf and finfo.min additive) over caches
long enough for several key splits and blocks hidden, visible and cut; fully masked rows; the window; NaN in the k
and v of hidden keys (never read) and at a key one head of a group sees and another does not; the thread count
(bitwise); an all-true mask costs nothing (bitwise the unmasked result); which kernel ran (the profiler event
cs149gpt::flash_decode that module.cpp records around the decode kernel); attention_with_kvcache unchanged.
"""
import pytest
import torch
from torch.profiler import profile

import cs149gpt
from tests._helpers import gen, isa  # noqa: F401  (isa: fixture)
from tests.test_masks import (NEG_INF, inputs, mask_shapes, out_problems, random_additive_mask, random_bool_mask,
                              ref_masked, window_mask)

DECODE_EVENT = "cs149gpt::flash_decode"

# (B, Hq, Hkv, Nq, Nk, d): one split of few blocks; several splits (700 keys: 256-key splits) with GQA 2 and 4.
SHAPES = [
    (2, 4, 2, 1, 53, 24),
    (2, 4, 2, 3, 700, 32),
    (1, 8, 2, 16, 300, 16),
    (3, 4, 1, 1, 200, 64),
]


def decode_kernel_runs(fn):
    """(fn(), how many times the decode kernel ran in it)."""
    with profile() as prof:
        result = fn()
    return result, sum(1 for e in prof.events() if e.name == DECODE_EVENT)


def masks_for(kind, shape, g, dtype):
    if kind == "bool":
        return random_bool_mask(shape, g)
    return random_additive_mask(shape, g, torch.float32 if shape[-1] % 2 else dtype)


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_every_mask_shape(isa, dtype, kind):
    """out and lse of the decode kernel for every broadcast shape of the mask, with each causal mode."""
    g = gen(1300)
    failures = []
    for b, hq, hkv, n_q, n_k, d in SHAPES if dtype == torch.float32 else SHAPES[:2]:
        q, k, v, _ = inputs((b, hq, n_q, d), (b, hkv, n_k, d), g, dtype)
        for shape in mask_shapes(b, hq, n_q, n_k) + [(b, hq, 1, n_k), (1, 1, 1, n_k)]:
            mask = masks_for(kind, shape, g, dtype)
            for is_causal in (False, True, "bottom_right"):
                out, lse = cs149gpt.attention(q, k, v, attn_mask=mask, is_causal=is_causal, return_lse=True)
                failures += out_problems(out, lse, q, k, v, mask, is_causal=is_causal,
                                         tag=f"{isa} {kind} mask {shape} {mask.dtype} causal={is_causal} "
                                             f"q {tuple(q.shape)} k {tuple(k.shape)}")
    assert not failures, "\n".join(failures[:20])


def padding_masks(b, n_q, n_k, firsts, lasts, dtype):
    """Key-padding masks as Hugging Face passes them: sequence i sees keys [firsts[i], lasts[i]); bool (B,1,1,K),
    its (B,1,Nq,K) expansion, additive −inf and additive finfo(dtype).min (its float padding mask)."""
    keep = torch.zeros(b, 1, 1, n_k, dtype=torch.bool)
    for i, (first, last) in enumerate(zip(firsts, lasts)):
        keep[i, ..., first:last] = True
    lowest = torch.finfo(dtype).min
    return {
        "bool (B,1,1,K)": keep,
        "bool (B,1,Nq,K)": keep.expand(b, 1, n_q, n_k),
        "-inf (B,1,1,K)": torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, NEG_INF),
        "finfo.min (B,1,Nq,K)": torch.zeros(b, 1, n_q, n_k, dtype=dtype).masked_fill(~keep, lowest),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_key_padding(isa, dtype):
    """Left- and right-padded batches over a cache of several splits: whole blocks and splits hidden, the padding's
    edge inside a block and on a block boundary, one sequence with no visible key (out 0, lse −inf)."""
    g = gen(1301)
    failures = []
    b, n_k = 5, 600  # 256-key splits
    firsts = [0, 130, 256, 599, 0]
    lasts = [600, 600, 600, 600, 0]  # the last sequence sees nothing
    for n_q in (1, 4) if dtype == torch.float32 else (1,):
        q, k, v, _ = inputs((b, 4, n_q, 32), (b, 2, n_k, 32), g, dtype)
        for left in (True, False):
            # right padding: sequence i sees keys [0, 1000 − firsts[i]) (the last still none)
            f, l_ = (firsts, lasts) if left else ([0] * b, [n_k - x for x in firsts[:4]] + [0])
            for name, mask in padding_masks(b, n_q, n_k, f, l_, dtype).items():
                for is_causal in (False, "bottom_right") if n_q > 1 else (False,):
                    out, lse = cs149gpt.attention(q, k, v, attn_mask=mask, is_causal=is_causal, return_lse=True)
                    if name.startswith("finfo"):
                        # finfo.min is finite: a sequence that sees nothing averages every key (torch's answer), so
                        # the reference is the additive mask itself.
                        failures += out_problems(out, lse, q, k, v, mask, is_causal=is_causal,
                                                 tag=f"{isa} {name} left={left} n_q={n_q}")
                    else:
                        failures += out_problems(out, lse, q, k, v, mask, is_causal=is_causal,
                                                 tag=f"{isa} {name} left={left} n_q={n_q} causal={is_causal}")
                        dead = lse[-1]
                        if not (torch.isneginf(dead).all() and (out[-1] == 0).all()):
                            failures.append(f"{isa} {name}: the fully masked sequence is not 0 / -inf")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_key_ranges_with_causal(isa, dtype):
    """Key padding (a run of keys per row: the kernels take it as key ranges) together with the causal mask, the
    padding's end at every key near the causal diagonal, so that it cuts some rows' causal prefixes and not others.
    (Rows whose shown keys coincided shared one look at the mask although their causal prefixes differed: a row the
    padding cut took the unmasked path and attended to hidden keys.)"""
    g = gen(1308)
    failures = []
    for n_q, n_k in ((2, 2), (3, 2), (3, 7), (5, 40), (16, 40), (4, 300)):
        ends = sorted({max(1, e) for e in range(n_k - n_q - 2, n_k + 1)} | {1, n_k // 2})
        b = len(ends)
        q, k, v, _ = inputs((b, 4, n_q, 16), (b, 2, n_k, 16), g, dtype)
        shown = torch.arange(n_k)[None, :] < torch.tensor(ends)[:, None]  # (b, Nk): sequence i sees keys < ends[i]
        for mask in (shown[:, None, None, :], shown[:, None, None, :].expand(b, 1, n_q, n_k),
                     torch.where(shown, 0.0, float("-inf"))[:, None, None, :].to(dtype)):
            for is_causal in (True, "bottom_right"):
                out, lse = cs149gpt.attention(q, k, v, attn_mask=mask, is_causal=is_causal, return_lse=True)
                failures += out_problems(out, lse, q, k, v, mask, is_causal=is_causal,
                                         tag=f"{isa} Nq={n_q} Nk={n_k} mask {tuple(mask.shape)} {mask.dtype} "
                                             f"causal={is_causal}")
    assert not failures, "\n".join(failures[:20])


def test_decode_fully_masked_rows_match_torch():
    """Rows whose mask hides every key: 0 as torch's SDPA on the CPU, for bool and −inf masks, while other heads of
    the same GQA group see keys."""
    g = gen(1302)
    q, k, v, _ = inputs((2, 4, 2, 16), (2, 2, 300, 16), g)
    mask = random_bool_mask((2, 4, 2, 300), g)
    mask[0, 1] = False       # head 1 of sequence 0 sees nothing (head 0 of its group does)
    mask[1, :, 1] = False    # row 1 of sequence 1, every head
    for m in (mask, torch.zeros(mask.shape).masked_fill(~mask, NEG_INF)):
        out = cs149gpt.attention(q, k, v, attn_mask=m)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        assert (out[0, 1] == 0).all() and (out[1, :, 1] == 0).all()
        assert (out - want).abs().max().item() <= 1e-5


def test_decode_window(isa):
    """The sliding window alone, with is_causal and with a padding mask, on the decode kernel."""
    g = gen(1303)
    failures = []
    for n_q, n_k, dtype in ((1, 400, torch.float32), (5, 130, torch.float32), (1, 300, torch.bfloat16)):
        q, k, v, _ = inputs((2, 4, n_q, 32), (2, 2, n_k, 32), g, dtype)
        pad = random_bool_mask((2, 1, 1, n_k), g, p_keep=0.8, dead_rows=False)
        for left, right in ((0, 0), (3, 0), (70, 5), (-1, 2), (200, -1)):
            band = window_mask(n_q, n_k, left, right)
            for is_causal, mask in ((False, None), ("bottom_right", None), (False, pad)):
                want_mask = band if mask is None else band & mask
                out, lse = cs149gpt.attention(q, k, v, window=(left, right), is_causal=is_causal,
                                              attn_mask=mask, return_lse=True)
                failures += out_problems(out, lse, q, k, v, want_mask, is_causal=is_causal,
                                         tag=f"{isa} {dtype} window=({left}, {right}) causal={is_causal} "
                                             f"mask={mask is not None} ({n_q}, {n_k})")
    assert not failures, "\n".join(failures[:20])


def test_decode_hidden_keys_are_never_read(isa):
    """NaN in the k and v of keys the mask hides leaves every row finite and right (blocks hidden whole, and blocks
    the padding cuts, where P V goes key run by key run); a NaN value at a key that one head of a GQA group sees
    and the other does not turns only the first's row NaN (the README's rule)."""
    g = gen(1304)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, _ = inputs((2, 4, 1, 16), (2, 2, 400, 16), g, dtype)
        mask = torch.ones(2, 1, 1, 400, dtype=torch.bool)
        mask[0, ..., :150] = False   # left padding
        mask[1, ..., 390:] = False   # right padding
        mask[1, ..., 70] = False     # a hole
        hidden = ~mask[:, 0, 0]
        k_bad, v_bad = k.clone(), v.clone()
        k_bad[hidden[:, None, :].expand(2, 2, 400)] = float("nan")
        v_bad[hidden[:, None, :].expand(2, 2, 400)] = float("nan")
        out, lse = cs149gpt.attention(q, k_bad, v_bad, attn_mask=mask, return_lse=True)
        assert torch.isfinite(out).all(), dtype
        assert not out_problems(out, lse, q, k, v, mask, tag=f"nan in hidden keys {dtype}")

        # a scattered mask (many runs of shown keys a block), NaN at every key it hides
        scattered = random_bool_mask((2, 1, 1, 400), g, p_keep=0.6)
        k_bad, v_bad = k.clone(), v.clone()
        k_bad[~scattered[:, 0, 0][:, None, :].expand(2, 2, 400)] = float("nan")
        v_bad[~scattered[:, 0, 0][:, None, :].expand(2, 2, 400)] = float("inf")
        out, lse = cs149gpt.attention(q, k_bad, v_bad, attn_mask=scattered, return_lse=True)
        assert torch.isfinite(out).all(), dtype
        assert not out_problems(out, lse, q, k, v, scattered, tag=f"inf in scattered hidden keys {dtype}")

        per_head = torch.ones(2, 4, 1, 400, dtype=torch.bool)
        per_head[:, 0, :, 5] = False  # head 0 hides key 5; head 1 (same kv head) sees it
        v_nan = v.clone()
        v_nan[:, 0, 5] = float("nan")
        out = cs149gpt.attention(q, k, v_nan, attn_mask=per_head)
        assert torch.isfinite(out[:, 0]).all() and torch.isnan(out[:, 1]).all(), dtype
        want, _ = ref_masked(q[:, :1].double(), k[:, :1].double(), v[:, :1].double(), per_head[:, :2])
        assert (out[:, 0].double() - want[:, 0]).abs().max().item() <= (1e-4 if dtype == torch.float32 else 2e-2)


def test_decode_results_do_not_depend_on_thread_count(restore_threads):
    g = gen(1305)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, _ = inputs((2, 8, 2, 64), (2, 2, 900, 64), g, dtype)
        masks = (random_bool_mask((2, 1, 1, 900), g), random_additive_mask((2, 8, 2, 900), g))
        for mask in masks:
            results = []
            for threads in (1, 2, 3, 5):
                torch.set_num_threads(threads)
                results.append(cs149gpt.attention(q, k, v, attn_mask=mask, return_lse=True))
            for other in results[1:]:
                assert all(torch.equal(a, b) for a, b in zip(results[0], other)), (dtype, mask.dtype)


def test_an_all_true_mask_takes_the_unmasked_path(isa):
    """A mask that hides nothing (bool True, additive 0) classifies every block visible: the bits of the unmasked
    call, with and without the causal mask."""
    g = gen(1306)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, _ = inputs((2, 4, 3, 32), (2, 2, 600, 32), g, dtype)
        for mask in (torch.ones(2, 1, 1, 600, dtype=torch.bool), torch.zeros(2, 1, 3, 600, dtype=dtype)):
            for is_causal in (False, "bottom_right"):
                assert torch.equal(cs149gpt.attention(q, k, v, attn_mask=mask, is_causal=is_causal),
                                   cs149gpt.attention(q, k, v, is_causal=is_causal)), (dtype, mask.dtype, is_causal)


def test_which_kernel_runs():
    """Decoding calls (Nq <= 16) run the decode kernel with a mask or a window as without; prefill, given tiles and
    dropout keep the tiled kernel; attention_with_kvcache runs the decode kernel and is unchanged by all this."""
    g = gen(1307)
    q, k, v, _ = inputs((2, 4, 1, 16), (2, 2, 90, 16), g)
    pad = random_bool_mask((2, 1, 1, 90), g, dead_rows=False)
    additive = random_additive_mask((2, 4, 1, 90), g)
    decode_calls = {
        "no mask": lambda: cs149gpt.attention(q, k, v),
        "bool mask": lambda: cs149gpt.attention(q, k, v, attn_mask=pad),
        "additive mask": lambda: cs149gpt.attention(q, k, v, attn_mask=additive),
        "window": lambda: cs149gpt.attention(q, k, v, window=(10, 0)),
        "sdpa with mask": lambda: cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=pad, enable_gqa=True),
        "16 rows": lambda: cs149gpt.attention(torch.randn(2, 4, 16, 16), k, v, attn_mask=pad, is_causal=True),
    }
    for name, call in decode_calls.items():
        assert decode_kernel_runs(call)[1] == 1, name
    tiled_calls = {
        "17 rows": lambda: cs149gpt.attention(torch.randn(2, 4, 17, 16), k, v, attn_mask=pad),
        "tiles given": lambda: cs149gpt.attention(q, k, v, attn_mask=pad, block_q=1, block_k=16),
        "dropout": lambda: cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=pad, dropout_p=0.5,
                                                                 enable_gqa=True),
        "naive": lambda: cs149gpt.attention(q, k, v, impl="naive"),
    }
    for name, call in tiled_calls.items():
        assert decode_kernel_runs(call)[1] == 0, name

    # attention_with_kvcache: the decode kernel, and the same result as attention() on the cache's valid prefix.
    k_cache, v_cache = torch.zeros(2, 2, 128, 16), torch.zeros(2, 2, 128, 16)
    lengths = torch.tensor([90, 41], dtype=torch.int32)
    k_cache[:, :, :90], v_cache[:, :, :90] = k, v
    out, runs = decode_kernel_runs(lambda: cs149gpt.attention_with_kvcache(q, k_cache, v_cache, lengths))
    assert runs == 1
    for i, n in enumerate(lengths.tolist()):
        want = cs149gpt.attention(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n])
        assert (out[i:i + 1] - want).abs().max().item() <= 1e-6
    # and the equivalent right-padding mask on attention(), through the masked decode path
    right_pad = torch.arange(128)[None, None, None, :] < lengths[:, None, None, None]
    masked = cs149gpt.attention(q, k_cache, v_cache, attn_mask=right_pad)
    assert (masked - out).abs().max().item() <= 1e-6
