"""torch.ops.cs149gpt.merge_partial_: two partial attention results over disjoint key sets folded into one (ring
attention's step), on the CPU and, where torch sees one, the GPU.

The reference is float64 attention over the union of the keys; the partials are float64 attention over each set,
rounded to the dtypes the op takes (the running one float32, the block's float32/bfloat16/float16).
"""
import math

import pytest
import torch

import cs149gpt  # noqa: F401  (loads the operators)

merge = torch.ops.cs149gpt.merge_partial_

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="no CUDA GPU here"))]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def attention64(q, k, v):
    """float64 attention and its lse, from the definition."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def partials(device, b=2, h=3, n=37, d=64, keys=(50, 29), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, sum(keys), d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, sum(keys), d, generator=g, dtype=torch.float64)
    whole = attention64(q, k, v)
    a = attention64(q, k[:, :, :keys[0]], v[:, :, :keys[0]])
    blk = attention64(q, k[:, :, keys[0]:], v[:, :, keys[0]:])
    return [t.to(device) for t in (*whole, *a, *blk)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 40])
def test_equals_attention_over_both_key_sets(device, dtype, d):
    out, lse, out_a, lse_a, out_b, lse_b = partials(device, d=d)
    acc, acc_lse = out_a.float(), lse_a.float()
    block = out_b.to(dtype)
    merge(acc, acc_lse, block, lse_b.float())
    # the block's rounding to dtype is the only error beyond float32's
    bound = TOLERANCE[dtype] + (out_b - block.double()).abs().max().item()
    assert (acc.double() - out).abs().max().item() <= bound
    assert (acc_lse.double() - lse).abs().max().item() <= 2e-6


@pytest.mark.parametrize("device", DEVICES)
def test_strided_views_in_place(device):
    """The ring merges into row slices of its running buffers: views with strides, written where they are."""
    out, lse, out_a, lse_a, out_b, lse_b = partials(device, n=40)
    big = torch.full((2, 3, 100, 64), 7.0, device=device)
    big_lse = torch.full((2, 3, 100), 7.0, device=device)
    acc, acc_lse = big[:, :, 30:70], big_lse[:, :, 30:70]
    acc.copy_(out_a)
    acc_lse.copy_(lse_a)
    block_buf = torch.zeros(3, 2, 40, 64, device=device).transpose(0, 1)  # out_block strided too
    block_buf.copy_(out_b)
    lse_b_buf = torch.zeros(2, 40, 3, device=device).permute(0, 2, 1)
    lse_b_buf.copy_(lse_b)
    merge(acc, acc_lse, block_buf, lse_b_buf)
    assert (big[:, :, 30:70].double() - out).abs().max().item() <= 2e-6
    assert (big_lse[:, :, 30:70].double() - lse).abs().max().item() <= 2e-6
    assert (big[:, :, :30] == 7).all() and (big[:, :, 70:] == 7).all()  # the rows around untouched
    assert (big_lse[:, :, :30] == 7).all() and (big_lse[:, :, 70:] == 7).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_rows(device):
    """NaN in either lse: the row NaN; −inf on one side: the other side exactly; −inf on both: 0 and −inf."""
    inf, nan = math.inf, math.nan
    lse_a = torch.tensor([[[nan, 0.5, -inf, -inf, 1.0]]], device=device)
    lse_b = torch.tensor([[[0.0, nan, 2.0, -inf, -inf]]], device=device)
    out_a = torch.randn(1, 1, 5, 8, device=device)
    out_a[:, :, 3] = 0.0  # a row no key reached: the kernel's 0
    out_b = torch.randn(1, 1, 5, 8, device=device)
    out_b[:, :, 3:] = 0.0
    acc, acc_lse = out_a.clone(), lse_a.clone()
    merge(acc, acc_lse, out_b, lse_b)
    assert acc[0, 0, :2].isnan().all() and acc_lse[0, 0, :2].isnan().all()
    assert torch.equal(acc[0, 0, 2], out_b[0, 0, 2]) and acc_lse[0, 0, 2].item() == 2.0
    assert torch.equal(acc[0, 0, 3], torch.zeros(8, device=device)) and acc_lse[0, 0, 3].item() == -inf
    assert torch.equal(acc[0, 0, 4], out_a[0, 0, 4]) and acc_lse[0, 0, 4].item() == 1.0


def test_same_bits_on_any_thread_count(restore_threads):
    out, lse, out_a, lse_a, out_b, lse_b = partials("cpu", b=4, h=8, n=300, d=128)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        acc, acc_lse = out_a.float(), lse_a.float()
        merge(acc, acc_lse, out_b.bfloat16(), lse_b.float())
        results.append((acc, acc_lse))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile(device):
    out, lse, out_a, lse_a, out_b, lse_b = partials(device)
    args = (out_a.float(), lse_a.float(), out_b.bfloat16(), lse_b.float())
    torch.library.opcheck(merge, args)

    def step(acc, acc_lse, block, block_lse):
        merge(acc, acc_lse, block, block_lse)
        return acc * 2

    eager = [t.clone() for t in args]
    compiled = [t.clone() for t in args]
    expected = step(*eager)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled)
    assert torch.equal(got, expected) and torch.equal(compiled[1], eager[1])


@pytest.mark.parametrize("device", DEVICES)
def test_ring_views_under_compile(device):
    """The ring's call: row slices of the running buffers, compiled with inductor, as eager."""
    out, lse, out_a, lse_a, out_b, lse_b = partials(device, n=8)
    big, big_lse = torch.zeros(2, 3, 20, 64, device=device), torch.zeros(2, 3, 20, device=device)

    def step(acc, acc_lse, block, block_lse):
        merge(acc[:, :, 4:12], acc_lse[:, :, 4:12], block, block_lse)
        return acc_lse * 2  # (exact: a compiled exp may differ from eager by an ulp)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        acc, acc_lse = big.clone(), big_lse.clone()
        acc[:, :, 4:12], acc_lse[:, :, 4:12] = out_a.float(), lse_a.float()
        results.append((fn(acc, acc_lse, out_b.bfloat16(), lse_b.float()), acc))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows_and_head_dim_zero(device):
    acc, acc_lse = torch.zeros(1, 2, 0, 8, device=device), torch.zeros(1, 2, 0, device=device)
    merge(acc, acc_lse, torch.zeros(1, 2, 0, 8, device=device), torch.zeros(1, 2, 0, device=device))
    assert acc.shape == (1, 2, 0, 8)
    # no columns, but each row's lse still merges: log(e^0 + e^0)
    acc, acc_lse = torch.zeros(1, 2, 3, 0, device=device), torch.zeros(1, 2, 3, device=device)
    merge(acc, acc_lse, torch.zeros(1, 2, 3, 0, device=device), torch.zeros(1, 2, 3, device=device))
    assert torch.allclose(acc_lse, torch.full_like(acc_lse, math.log(2)))


def test_refuses_tensors_that_require_grad():
    """No backward: a tensor that requires grad is refused (not rewritten behind autograd), no_grad lets it run."""
    out, lse, out_a, lse_a, out_b, lse_b = partials("cpu")
    acc, acc_lse, block, block_lse = out_a.float(), lse_a.float(), out_b.float(), lse_b.float()
    for name, t in (("out", acc), ("out_block", block)):
        t.requires_grad_()
        with pytest.raises(ValueError, match=f"has no backward, but {name} requires grad"):
            merge(acc, acc_lse, block, block_lse)
        t.requires_grad_(False)
    block.requires_grad_()
    with torch.no_grad():
        merge(acc, acc_lse, block, block_lse)
    assert (acc.double() - out).abs().max().item() <= 2e-6


def test_refuses_inputs_sharing_memory_with_outputs():
    buf, lse = torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5)
    with pytest.raises(ValueError, match="out and out_block share memory in part"):
        merge(buf[:, :, 1:], lse[:, :, 1:], buf[:, :, :4], torch.zeros(1, 1, 4))
    flat = torch.zeros(40 + 5)
    with pytest.raises(ValueError, match="out and lse share memory"):
        merge(flat[:40].view(1, 1, 5, 8), flat[35:40].view(1, 1, 5), torch.zeros(1, 1, 5, 8), torch.zeros(1, 1, 5))
    # one tensor as both sides is each row merged with itself: allowed, lse + log 2, out unchanged
    acc, acc_lse = buf.clone(), lse.clone()
    merge(acc, acc_lse, acc, acc_lse)
    assert torch.allclose(acc, buf, atol=1e-6) and torch.allclose(acc_lse, lse + math.log(2), atol=1e-6)


def bad(**change):
    args = dict(out=torch.zeros(1, 2, 3, 8), lse=torch.zeros(1, 2, 3), out_block=torch.zeros(1, 2, 3, 8),
                lse_block=torch.zeros(1, 2, 3))
    args.update(change)
    return args


@pytest.mark.parametrize("args, error, words", [
    (bad(out=torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)), TypeError, "out must be float32"),
    (bad(out_block=torch.zeros(1, 2, 3, 8, dtype=torch.float64)), TypeError, "out_block must be float32, bfloat16"),
    (bad(lse_block=torch.zeros(1, 2, 3, dtype=torch.bfloat16)), TypeError, "lse_block must be float32"),
    (bad(out_block=torch.zeros(1, 2, 4, 8)), ValueError, "out_block must have the shape of out"),
    (bad(lse=torch.zeros(1, 2, 4)), ValueError, "lse must have shape (batch, heads, rows)"),
    (bad(out=torch.zeros(2, 3, 8), lse=torch.zeros(2, 3)), ValueError, "out must have shape (batch, heads, rows, "),
    (bad(out_block=torch.zeros(1, 2, 8, 3).transpose(-1, -2)), ValueError, "out_block must have a contiguous last"),
    (bad(out=torch.zeros(1, 1, 3, 8).expand(1, 2, 3, 8)), ValueError, "out has elements that share memory"),
    (bad(lse_block=torch.zeros(1, 2, 3, device="meta")), ValueError, "must be on one device"),
    (bad(lse=None), ValueError, "lse must be a tensor, got None"),
    (bad(lse=torch.zeros(6)), ValueError, "lse must have shape (batch, heads, rows) [1, 2, 3]"),
    (bad(lse_block=torch.zeros(1, 2, 3, 1)), ValueError, "lse_block must have shape (batch, heads, rows)"),
])
def test_bad_input(args, error, words):
    with pytest.raises(error) as e:
        merge(**args)
    assert words in str(e.value)
