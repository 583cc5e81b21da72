"""The entry points of CS149 assignment 4, re-exported by cs149gpt: math (scale 1, no mask) against float64,
argument checks, and the twoDimRead / fourDimRead helpers."""
import pytest
import torch

import cs149gpt
from tests._helpers import TOL, gen, isa, mismatch, module, randn  # noqa: F401  (isa: fixture)

ENTRY_POINTS = ("myNaiveAttention", "myUnfusedAttentionBlocked", "myFusedAttention", "myFlashAttention")


def call(name, Q, K, V, B, H, N, d, *, Br=16, Bc=16, scratch=None):
    """Calls an entry point with the assignment's signature; scratch tensors are whatever the caller gives."""
    fn = getattr(cs149gpt, name)
    if scratch is None:
        scratch = torch.zeros(N, N)
    if name == "myFlashAttention":
        # Q, K, V, Qi, Kj, Vj, Sij, Pij, PV, Oi, L, Li, Lij, Lnew, Bc, Br, B, H, N, d
        return fn(Q, K, V, *[scratch] * 11, Bc, Br, B, H, N, d)
    return fn(Q, K, V, scratch, B, H, N, d)


def test_reexports():
    m = module()
    assert set(cs149gpt.ASSIGNMENT_ENTRY_POINTS) <= set(cs149gpt.__all__)
    for name in cs149gpt.ASSIGNMENT_ENTRY_POINTS:
        assert getattr(cs149gpt, name) is getattr(m, name)
    with pytest.raises(AttributeError, match="no attribute 'myMagicAttention'"):
        cs149gpt.myMagicAttention


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_matches_reference(isa, name):
    """softmax(Q Kᵀ) V with scale 1 (d = 17 and 64 tell 1 from 1/sqrt(d)) and no mask."""
    g = gen(20)
    failures = []
    for B, H, N, d in [(1, 1, 1, 1), (2, 3, 33, 17), (1, 2, 70, 64), (3, 1, 5, 2)]:
        Q, K, V = (randn(B, H, N, d, gen=g) * 0.5 for _ in range(3))
        for scratch in (torch.zeros(N, N), torch.empty(0), torch.randn(3, 1, 4)):
            out = call(name, Q, K, V, B, H, N, d, scratch=scratch)
            problem = mismatch(out, Q, K, V, scale=1.0, is_causal=False, tol=TOL)
            if problem:
                failures.append(f"(B,H,N,d)=({B},{H},{N},{d}) scratch {tuple(scratch.shape)}: {problem}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_non_contiguous_inputs(name):
    g = gen(21)
    B, H, N, d = 2, 2, 29, 20
    Q = randn(B, N, H, d, gen=g).transpose(1, 2)  # (B, H, N, d) view of a (B, N, H, d) tensor
    K = randn(B, H, N, d, gen=g).transpose(2, 3).contiguous().transpose(2, 3)  # column-major rows
    V = randn(B, H, 2 * N, d, gen=g)[:, :, ::2]  # every other row
    assert not (Q.is_contiguous() or K.is_contiguous() or V.is_contiguous())
    before = [t.clone() for t in (Q, K, V)]
    out = call(name, Q, K, V, B, H, N, d)
    assert mismatch(out, Q, K, V, scale=1.0) is None, mismatch(out, Q, K, V, scale=1.0)
    assert all(torch.equal(t, t0) for t, t0 in zip((Q, K, V), before)), "an input was modified"


@pytest.mark.parametrize("Br,Bc", [(1, 1), (3, 17), (17, 3), (1, 64), (64, 1), (100, 100), (29, 29)])
def test_flash_block_sizes(Br, Bc):
    """Br and Bc of any size, including not dividing N and larger than N (Bc comes before Br)."""
    g = gen(22)
    B, H, N, d = 1, 2, 29, 17
    Q, K, V = (randn(B, H, N, d, gen=g) for _ in range(3))
    out = call("myFlashAttention", Q, K, V, B, H, N, d, Br=Br, Bc=Bc)
    assert mismatch(out, Q, K, V, scale=1.0) is None, mismatch(out, Q, K, V, scale=1.0)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_integers_that_disagree_with_the_tensors(name):
    """Wrong B, H, N or d (too large or too small) is a ValueError naming the shapes, never a read past the
    end of a tensor."""
    B, H, N, d = 2, 3, 10, 8
    Q, K, V = (torch.randn(B, H, N, d) for _ in range(3))
    for i, label in enumerate("BHNd"):
        for delta in (1, -1, 1000):
            dims = [B, H, N, d]
            dims[i] += delta
            with pytest.raises(ValueError, match=r"Q has shape \[2, 3, 10, 8\] but the arguments say"):
                call(name, Q, K, V, *dims)
    # The tensors disagree with each other: the one that differs is named.
    with pytest.raises(ValueError, match=r"K has shape \[2, 3, 11, 8\]"):
        call(name, Q, torch.randn(B, H, N + 1, d), V, B, H, N, d)
    with pytest.raises(ValueError, match=r"V has shape \[2, 3, 10, 7\]"):
        call(name, Q, K, torch.randn(B, H, N, d - 1), B, H, N, d)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_not_4d(name):
    q3 = torch.randn(3, 10, 8)
    with pytest.raises(ValueError, match="Q must be a 4-D tensor"):
        call(name, q3, q3, q3, 1, 3, 10, 8)
    q4 = torch.randn(1, 3, 10, 8)
    with pytest.raises(ValueError, match="V must be a 4-D tensor"):
        call(name, q4, q4, q3, 1, 3, 10, 8)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_wrong_dtype(name):
    Q = torch.randn(1, 2, 5, 4)
    with pytest.raises(TypeError, match="float32"):
        call(name, Q.double(), Q.double(), Q.double(), 1, 2, 5, 4)
    with pytest.raises(TypeError, match="share one dtype"):
        call(name, Q, Q.double(), Q, 1, 2, 5, 4)


@pytest.mark.parametrize("Br,Bc", [(0, 4), (4, 0), (-1, 4), (4, -3), (0, 0)])
def test_flash_nonpositive_blocks(Br, Bc):
    Q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=f"Br and Bc must be >= 1, got Br = {Br}, Bc = {Bc}"):
        call("myFlashAttention", Q, Q, Q, 1, 2, 8, 4, Br=Br, Bc=Bc)


# ---------------------------------------------------------------------------------------------------------
# twoDimRead / fourDimRead
# ---------------------------------------------------------------------------------------------------------
def test_two_dim_read():
    t = torch.randn(7, 5, generator=gen(23))
    flat = t.flatten().tolist()
    for i, j in [(0, 0), (0, 4), (3, 2), (6, 0), (6, 4), (5, 1)]:
        assert cs149gpt.twoDimRead(flat, i, j, 5) == t[i][j].item()
        assert cs149gpt.twoDimRead(flat, i, j, 5) == flat[i * 5 + j]


def test_four_dim_read():
    B, H, N, d = 2, 3, 4, 5
    t = torch.randn(B, H, N, d, generator=gen(24))
    flat = t.flatten().tolist()
    idx = [(0, 0, 0, 0), (1, 2, 3, 4), (0, 1, 2, 3), (1, 0, 3, 1), (0, 2, 0, 4), (1, 1, 1, 0)]
    for x, y, z, b in idx:
        # sizeX, sizeY, sizeZ = H, N, d: list[x*H*N*d + y*N*d + z*d + b]
        assert cs149gpt.fourDimRead(flat, x, y, z, b, H, N, d) == t[x][y][z][b].item()
    # every element once: the index map is the row-major one
    got = [cs149gpt.fourDimRead(flat, x, y, z, b, H, N, d)
           for x in range(B) for y in range(H) for z in range(N) for b in range(d)]
    assert got == flat


def test_read_out_of_range_is_index_error():
    flat = torch.randn(2, 3, 4, 5).flatten().tolist()
    H, N, d = 3, 4, 5
    for x, y, z, b in [(2, 0, 0, 0), (0, 3, 0, 0), (0, 0, 4, 0), (0, 0, 0, 5), (-1, 0, 0, 0), (0, -1, 0, 0),
                       (0, 0, -1, 0), (0, 0, 0, -1), (10**12, 0, 0, 0)]:
        with pytest.raises(IndexError, match="fourDimRead index"):
            cs149gpt.fourDimRead(flat, x, y, z, b, H, N, d)
    flat2 = torch.randn(7, 5).flatten().tolist()
    for i, j in [(7, 0), (0, 5), (-1, 0), (0, -1), (10**12, 1)]:
        with pytest.raises(IndexError, match="twoDimRead index"):
            cs149gpt.twoDimRead(flat2, i, j, 5)
    with pytest.raises(IndexError):
        cs149gpt.twoDimRead([], 0, 0, 1)


def test_read_bad_sizes_is_value_error():
    flat = [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="sizeX must be >= 1"):
        cs149gpt.twoDimRead(flat, 0, 0, 0)
    for sizes in [(0, 1, 1), (1, 0, 1), (1, 1, -2)]:
        with pytest.raises(ValueError, match="sizeX, sizeY, sizeZ must be >= 1"):
            cs149gpt.fourDimRead(flat, 0, 0, 0, 0, *sizes)
