"""Context-parallel (ring) attention: one sequence sharded over the ranks of a torch.distributed process group.

    import torch.distributed as dist
    from cs149gpt.distributed import ring_attention, shard_sequence, unshard_sequence

    q = shard_sequence(q_full, 2, layout="zigzag")            # (B, H, N / W, d): this rank's tokens
    k, v = (shard_sequence(t, 2, layout="zigzag") for t in (k_full, v_full))
    out = ring_attention(q, k, v, is_causal=True, layout="zigzag")   # (B, H, N / W, d), differentiable
    out_full = unshard_sequence(out, 2, layout="zigzag")     # (B, H, N, d) on every rank (an all_gather)

Each rank holds a slice of Q, K and V along the sequence. The K/V slices travel around the ring (rank r sends to
r + 1 and receives from r − 1, W − 1 hops); at each step the rank runs cs149gpt's flash kernel
(torch.ops.cs149gpt.flash_attention, which returns lse) on its queries and the K/V block it holds, and merges that
partial result into its running one in float32 through the logsumexps (torch.ops.cs149gpt.merge_partial_, one pass
over the rows):

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a − lse)·out_a + exp(lse_b − lse)·out_b

The send of the next block is posted (batch_isend_irecv) before the current block is computed, so the transfer runs
behind the kernel. On one host with gloo (CPU) the forward has no transfers and no fixed share of the work: every
rank puts its Q, K and V in shared memory (/dev/shm, mapped by every rank of the group; CS149GPT_RING_SHM=0 turns it
off), and the ranks take items (a query chunk of some rank, one batch element and some of its kv heads, against
every rank's block, the partials merged as above) from a counter there, heaviest first, writing each item's rows
into its owner's out and lse: a rank slowed by a busy core or its neighbours' memory traffic takes fewer, as the
threads of one process do (ulysses_attention's all-to-alls go through shared memory too). The backward
(torch.ops.cs149gpt.flash_attention_backward, given the final out and lse) sends the K/V blocks around the ring once
more, each followed by its float32 dK/dV accumulator: every rank adds the gradient its queries give that block, and
after W hops the accumulator is back at the block's owner; dQ stays local. GQA: k and v have Hkv heads dividing q's
H and travel as they are (never expanded). The result equals a one-process cs149gpt.attention call on the whole
sequence up to float32 rounding of the merge (float32 inputs: about 1e-6 on unit-scale data; bfloat16/float16: each
block's partial output comes back from the kernel in that dtype, so a few of its ulps), and is bitwise the same from
run to run (a fixed order of operations for every row, whichever rank computes it, where every rank runs the same
number of threads; the work-shared forward's order differs from the ring's: the two routes agree to that rounding).

Other routes with the same contract: ulysses_attention (all-to-alls: the whole sequence for H / W heads a rank, one
kernel call) and usp_attention (both on a 2-D mesh: all-to-alls within Ulysses groups, the ring across them).

Layouts (the sequence of N tokens sharded over W ranks; every rank holds the same number of tokens):
    "contiguous": rank r holds tokens [r·N/W, (r+1)·N/W). With is_causal, rank r's queries see the blocks of
        ranks <= r only, so rank W − 1 works W times as long as rank 0.
    "zigzag": the sequence in 2W chunks, rank r holds chunks r and 2W − 1 − r (the head and the tail), so with
        is_causal every rank computes the same amount: step 0 is one causal call on the local block, every other
        step one full call on half the rows or half the keys. The local length must be even.
    shard_sequence / unshard_sequence / shard_positions convert a whole sequence (and its position ids, for rotary
    embeddings) to and from either layout.

Causal masks, in global positions (queries and keys both sharded, N_q = W·n_q and N_k = W·n_k tokens):
    is_causal=True or "top_left": query i sees keys j <= i (cs149gpt.attention's and torch SDPA's is_causal).
    "bottom_right": query i sees keys j <= i + N_k − N_q (the two sequences aligned at their ends).
    The same for N_q = N_k. With N_q ≠ N_k (a local query length different from the local key length) each rank's
    blocks are cut along the global diagonal, into at most two kernel calls per block. A query row that sees no
    key at all ("bottom_right" with N_q > N_k: its first N_q − N_k rows) gets 0 and lse −inf, as in one process;
    its gradients are 0.

Non-finite values follow the library's rule (README, "Non-finite values") block by block: a key the causal mask
hides is never read, a NaN or +inf among a row's visible logits makes the row NaN (its lse NaN, and the merge keeps
it NaN), a row that sees no key gets 0 and lse −inf. One corner differs from one process: a block in which every
visible logit of a row is −inf contributes exactly 0 to that row, even where its value rows hold NaN or inf (one
process multiplies them by the weight 0: NaN).

Checks: before the ring starts, one all_gather of a few int64 per rank (the shapes, dtype, layout, causal mode,
scale and whether a backward will run) — over the group's CPU backend where it has one (init_process_group(
backend="cpu:gloo,cuda:nccl")), so that the host goes on queueing while the GPU runs earlier work; over NCCL alone
on a stream of its own, whose kernel waits for a free SM (the GPU's earlier kernels to end) — ranks that disagree
get a ValueError on every rank naming the argument
and each rank's value, never a hang. A rank whose own input is wrong (not 4-D, heads not dividing, head dims or
dtypes differing, ...) raises ValueError/TypeError naming the argument, and the others raise ValueError naming that
rank. A transfer that fails or times out (the process group's timeout) raises RuntimeError naming the step.

Devices: the tensors' device. CPU tensors need a gloo group, CUDA tensors an NCCL group (one process per GPU;
"cpu:gloo,cuda:nccl" best, for the checks above); the kernels are cs149gpt's for that device (on CUDA:
bfloat16/float16 with d 64 or 128, or the float32 teaching kernel). group may be a ProcessGroup, None (the default
group) or a DeviceMesh (mesh_dim names the dimension of an n-D mesh).

Autocast: q, k, v are cast to autocast's dtype (torch SDPA's rule); out is in it, lse float32.

Not supported: attn_mask, window, dropout, softcap, ALiBi (ring_attention has no such arguments); torch.compile
runs it in eager mode (torch.compiler.disable: a graph break, since point-to-point transfers cannot be traced).

Training with the sequence sharded: the shipped GPT with GPT.set_context_parallel (its forward turns the rank's
tokens by the rotary angles of their global positions; `torchrun ... cs149gpt/train.py --context_parallel`), a
Hugging Face model with attn_implementation=cs149gpt.integration.register_transformers_ring(group) (position_ids =
shard_positions, shift_labels and num_items_in_batch for the loss: its docstring). Each rank's gradients are
those of its tokens: all-reduce them over the group, as over data-parallel ranks (tests/test_context_parallel.py).

torch's own context_parallel (torch.distributed.tensor.experimental) is an alternative to ring_attention, not a
host for it: it rewrites aten's CUDA SDPA ops (flash, efficient, cuDNN) on DTensors into its ring, with a kernel
fixed per op and no hook for another; on the CPU it stops at aten._scaled_dot_product_flash_attention_for_cpu
(no sharding strategy), and with cs149gpt.install_sdpa() at cs149gpt.flash_attention (the same). What composes is
the layout: its head-tail load balancer shards as layout="zigzag" does, so context_parallel(mesh, buffers=...,
buffer_seq_dims=...) may shard a batch whose model attends through ring_attention (the test does so, bit for bit).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import secrets
import socket
import struct
import weakref
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

import cs149gpt  # noqa: F401  (loads the extension: torch.ops.cs149gpt.*)

__all__ = ["ring_attention", "ulysses_attention", "usp_attention", "shard_sequence", "unshard_sequence",
           "shard_positions", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Tags keep the forward's, the backward's K/V and the backward's gradient messages apart on gloo (NCCL ignores them).
_TAG_FWD, _TAG_BWD_KV, _TAG_BWD_GRAD = 0, 2, 4


# ------------------------------------------------------------------------------------------------- the group
def _resolve_group(group, mesh_dim, who: str = "ring_attention"):
    """(process group or None for the default one, this rank's index in it, its size)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover (torch without DeviceMesh)
        DeviceMesh = ()
    if isinstance(group, DeviceMesh):
        if mesh_dim is None and group.ndim != 1:
            raise ValueError(f"{who}: group is a {group.ndim}-D DeviceMesh: pass mesh_dim (the dimension the "
                             "sequence is sharded over)")
        group = group.get_group(mesh_dim if mesh_dim is not None else 0)
    elif mesh_dim is not None:
        raise ValueError(f"{who}: mesh_dim needs group to be a DeviceMesh")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{who} needs torch.distributed initialised (dist.init_process_group)")
    return group, dist.get_rank(group), dist.get_world_size(group)


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


# ------------------------------------------------------------------------------------------------- layouts
def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}; got {layout!r}")


def _chunks(layout: str, world_size: int, rank: int, n_local: int) -> List[Tuple[int, int, int]]:
    """The rank's tokens as (local start, global start, length) runs."""
    if layout == "contiguous":
        return [(0, rank * n_local, n_local)]
    half = n_local // 2
    return [(0, rank * half, half), (half, (2 * world_size - 1 - rank) * half, half)]


def _world(group, world_size, rank) -> Tuple[int, int]:
    if world_size is None and rank is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("pass world_size and rank, or initialise torch.distributed (dist.init_process_group)")
        _, rank, world_size = _resolve_group(group, None)
    if world_size is None or rank is None or not 0 <= rank < world_size:
        raise ValueError(f"pass group, or both world_size and rank with 0 <= rank < world_size; got world_size="
                         f"{world_size}, rank={rank}")
    return world_size, rank


def shard_sequence(x: torch.Tensor, dim: int, group=None, *, world_size: Optional[int] = None,
                   rank: Optional[int] = None, layout: str = "contiguous") -> torch.Tensor:
    """This rank's slice of a whole sequence x along dim: "contiguous" → tokens [r·n, (r+1)·n) with n = N / W;
    "zigzag" → chunks r and 2W − 1 − r of 2W equal chunks, concatenated. The rank and W come from group (None: the
    default group) unless world_size and rank are given (no process group needed then). N must divide by W
    ("zigzag": by 2W), else ValueError. Returns a view for "contiguous", a new tensor for "zigzag"."""
    _check_layout(layout)
    world_size, rank = _world(group, world_size, rank)
    n = x.shape[dim]
    parts = world_size * (2 if layout == "zigzag" else 1)
    if n % parts:
        raise ValueError(f"x.shape[{dim}] = {n} does not divide into {parts} equal chunks ({layout!r} over "
                         f"{world_size} ranks)")
    chunks = x.chunk(parts, dim)
    if layout == "contiguous":
        return chunks[rank]
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


def shard_positions(n_total: int, group=None, *, world_size: Optional[int] = None, rank: Optional[int] = None,
                    layout: str = "contiguous", device=None) -> torch.Tensor:
    """The global positions (int64, (n_total / W,)) of this rank's tokens under layout: the position ids to give a
    model's rotary or learned position embedding for the sharded tokens."""
    return shard_sequence(torch.arange(n_total, device=device), 0, group, world_size=world_size, rank=rank,
                          layout=layout).contiguous()


def unshard_sequence(x: Union[torch.Tensor, Sequence[torch.Tensor]], dim: int, group=None, *,
                     layout: str = "contiguous") -> torch.Tensor:
    """The whole sequence back from the ranks' slices (the inverse of shard_sequence). x is this rank's slice (then
    every rank of group must call: an all_gather; the result has no autograd history) or the list of every rank's
    slices in rank order (no communication)."""
    _check_layout(layout)
    if isinstance(x, torch.Tensor):
        group, _, world_size = _resolve_group(group, None)
        slices = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world_size)]
        dist.all_gather(slices, x.detach().contiguous(), group=group)
    else:
        slices = list(x)
        world_size = len(slices)
    if layout == "contiguous":
        return torch.cat(slices, dim)
    halves = [s.chunk(2, dim) for s in slices]
    ordered = [halves[c][0] for c in range(world_size)] + [halves[world_size - 1 - c][1] for c in range(world_size)]
    return torch.cat(ordered, dim)


# ------------------------------------------------------------------------------------------------- the plan
# A block (this rank's queries × the K/V block of one source rank) becomes kernel calls (q_lo, q_hi, k_lo, k_hi,
# causal) on local rows and keys, causal being "none" or "bottom_right". Key j of a rectangle is visible to its
# query i iff j <= i + D (D in the rectangle's local coordinates); every call's rows see at least one key.
_FULL = math.inf


def _rect_d(pairs) -> Optional[float]:
    """One D for a rectangle made of chunk pairs (qo, nq, ko, nk, d_pair) (offsets inside the rectangle), or None
    when no single D describes its mask. _FULL: every key visible; -_FULL: none."""
    lo, hi = -math.inf, math.inf
    for qo, nq, ko, nk, d_pair in pairs:
        shift = ko - qo  # pair coordinates → rectangle coordinates: D_rect = d_pair + shift
        if d_pair >= nk - 1:  # the pair is full: D_rect >= nk - 1 + shift
            lo = max(lo, nk - 1 + shift)
        elif d_pair + nq - 1 < 0:  # the pair is empty: D_rect <= -nq + shift
            hi = min(hi, -nq + shift)
        else:
            lo, hi = max(lo, d_pair + shift), min(hi, d_pair + shift)
    if lo > hi:
        return None
    return lo if lo != -math.inf else hi


def _rect_calls(q_lo, nq, k_lo, nk, d) -> list:
    """The kernel calls for a rectangle of nq rows, nk keys and visibility j <= i + d."""
    if d >= nk - 1:
        return [(q_lo, q_lo + nq, k_lo, k_lo + nk, "none")]
    if d + nq - 1 < 0:
        return []
    d = int(d)
    first = max(0, -d)  # rows before it see no key
    split = min(nq, nk - d)  # rows from it on see every key
    calls = []
    # rows [first, split) with keys [0, d + split): bottom-right causal there is exactly j <= i + d
    if split > first:
        calls.append((q_lo + first, q_lo + split, k_lo, k_lo + d + split, "bottom_right"))
    if split < nq:
        calls.append((q_lo + split, q_lo + nq, k_lo, k_lo + nk, "none"))
    return calls


def _block_calls(q_chunks, k_chunks, offset: Optional[int]) -> list:
    """The fewest kernel calls for this rank's query chunks against one K/V block's chunks (chunks as _chunks gives
    them); offset: query at global position I sees key J iff J <= I + offset (None: no mask)."""
    nq = sum(c[2] for c in q_chunks)
    nk = sum(c[2] for c in k_chunks)
    if offset is None:
        return [(0, nq, 0, nk, "none")]

    def rect(qs, ks):
        q0, k0 = qs[0][0], ks[0][0]
        pairs = [(qc[0] - q0, qc[2], kc[0] - k0, kc[2], qc[1] + offset - kc[1]) for qc in qs for kc in ks]
        d = _rect_d(pairs)
        if d is None:
            return None
        return _rect_calls(q0, sum(c[2] for c in qs), k0, sum(c[2] for c in ks), d)

    groupings = [[(q_chunks, k_chunks)], [([qc], k_chunks) for qc in q_chunks],
                 [(q_chunks, [kc]) for kc in k_chunks], [([qc], [kc]) for qc in q_chunks for kc in k_chunks]]
    best = None
    for grouping in groupings:
        calls = [rect(qs, ks) for qs, ks in grouping]
        if any(c is None for c in calls):
            continue
        calls = [call for c in calls for call in c]
        if best is None or len(calls) < len(best):
            best = calls
    return best


def _offset(causal: str, world_size: int, nq: int, nk: int) -> Optional[int]:
    """_block_calls' offset for a causal mode and the local lengths."""
    return {"none": None, "top_left": 0, "bottom_right": world_size * (nk - nq)}[causal]


@functools.lru_cache(maxsize=256)
def _plan(layout: str, world_size: int, rank: int, nq: int, nk: int, offset: Optional[int]) -> tuple:
    """The rank's kernel calls against each source rank's block (cached: a call's host time is on the GPU's critical
    path at the ring's start)."""
    q_chunks = _chunks(layout, world_size, rank, nq)
    return tuple(tuple(_block_calls(q_chunks, _chunks(layout, world_size, src, nk), offset))
                 for src in range(world_size))


# ------------------------------------------------------------------------------------------------- the checks
def _causal_mode(is_causal) -> Optional[str]:
    if is_causal is True:
        return "top_left"
    if is_causal is False or is_causal is None:
        return "none"
    if isinstance(is_causal, str) and is_causal in ("top_left", "bottom_right"):
        return is_causal
    return None


def _local_error(q, k, v, who: str = "ring_attention") -> Optional[Exception]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            return ValueError(f"{who}: {name} must be 4-D (batch, heads, local length, head dim), got shape "
                              f"{tuple(t.shape)}")
    if q.dtype not in _DTYPES[:3] or k.dtype != q.dtype or v.dtype != q.dtype:
        return TypeError(f"{who}: q, k, v must share one dtype among float32, bfloat16, float16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        return ValueError(f"{who}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        return ValueError(f"{who}: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        return ValueError(f"{who}: k's batch {k.shape[0]} differs from q's {q.shape[0]}")
    if k.shape[3] != q.shape[3]:
        return ValueError(f"{who}: k's head dim {k.shape[3]} differs from q's {q.shape[3]}")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        return ValueError(f"{who}: k's heads ({k.shape[1]}) must divide q's ({q.shape[1]}) (GQA)")
    if min(q.shape) < 1 or min(k.shape) < 1:
        return ValueError(f"{who}: empty q {tuple(q.shape)} or k {tuple(k.shape)}")
    return None


_FIELDS = ("batch (q.shape[0])", "query heads (q.shape[1])", "key/value heads (k.shape[1])",
           "local query length (q.shape[2])", "local key length (k.shape[2])", "head dim (q.shape[3])", "dtype",
           "layout", "is_causal", "scale", "requires grad (a backward will run)", "CS149GPT_RING_SHM",
           "device (q.device)")


def _describe(field: int, value: int) -> str:
    name = _FIELDS[field]
    if name == "dtype":
        return str(_DTYPES[value]).replace("torch.", "")
    if name == "layout":
        return repr(LAYOUTS[value])
    if name == "is_causal":
        return repr(("none", "top_left", "bottom_right")[value])
    if name == "scale":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if name.startswith("requires grad"):
        return str(bool(value))
    if name == "CS149GPT_RING_SHM":
        return "shared memory allowed" if value else "0 (or no /dev/shm)"
    if name.startswith("device"):
        return ("cpu", "cuda")[value]
    return str(value)


_SIDE_STREAMS = {}


def _side_stream(device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _host_collectives(group) -> bool:
    """Whether the group runs collectives on CPU tensors: gloo, or a group with a CPU backend beside NCCL
    (init_process_group(backend="cpu:gloo,cuda:nccl")). Asked of the group's backends themselves: the name says
    nothing for a group made without a backend ("undefined", whose devices depend on the machine)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        pg._get_backend(torch.device("cpu"))
        return True
    except AttributeError:  # (not a ProcessGroup of this torch: by the backend's name)
        name = str(dist.get_backend(group))
        return name == "gloo" or "cpu:" in name
    except RuntimeError:  # no backend for CPU tensors
        return False


def _agree(group, world_size: int, device, local_error, fields: List[int], who: str = "ring_attention",
           extra: Sequence[Tuple[str, int]] = ()) -> None:
    """One all_gather of (status, *fields, *extra values) from every rank; raises on every rank unless all are fine
    and equal (ranks named by their global rank). extra: (name, value) pairs past _FIELDS."""
    fields = [*fields, *(value for _, value in extra)]
    # On the host where the group has a CPU backend: the GPU's queue is not involved, so the host goes on queueing
    # the call's kernels while the GPU still runs earlier work. Else on CUDA, on a stream of its own: the host waits
    # for the all_gather only, not for the kernels queued before the call (NCCL's stream waits on the stream current
    # at the call); but NCCL's kernel needs a free SM, which a persistent attention kernel running then does not
    # leave until it ends, so the host waits for the GPU to drain.
    if _host_collectives(group):
        device = torch.device("cpu")
    elif device.type == "cpu" and torch.cuda.is_available():  # (CPU tensors in an NCCL group: meet the others)
        device = torch.device("cuda", torch.cuda.current_device())
    side = _side_stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        mine = torch.tensor([0 if local_error is None else 1, *fields], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine, group=group)
        table = torch.stack(gathered).cpu().tolist()
    if local_error is not None:
        raise local_error
    ranks = [_global_rank(group, r) for r in range(world_size)]
    bad = [ranks[r] for r, row in enumerate(table) if row[0]]
    if bad:
        raise ValueError(f"{who}: rank(s) {bad} of the group rejected their local input (their error names "
                         "the argument); no rank started a transfer")
    wrong = []
    for f in range(len(fields)):
        values = [row[1 + f] for row in table]
        if len(set(values)) > 1:
            name = _FIELDS[f] if f < len(_FIELDS) else extra[f - len(_FIELDS)][0]
            show = (lambda x, f=f: _describe(f, x)) if f < len(_FIELDS) else str
            wrong.append(f"{name}: " + ", ".join(f"rank {ranks[r]}: {show(x)}" for r, x in enumerate(values)))
    if wrong:
        raise ValueError(f"{who}: the ranks disagree on " + "; ".join(wrong))


# ------------------------------------------------------------------------------------------------- same-host blocks
def _shm_allowed() -> bool:
    return (os.environ.get("CS149GPT_RING_SHM", "1") != "0" and os.path.isdir("/dev/shm")
            and hasattr(os, "posix_fallocate"))


class _HostBlocks:
    """The blocks of a gloo group whose ranks share one host, in shared memory: each rank's block in a file under
    /dev/shm that every rank maps, so that the forward reads the blocks it needs in place instead of receiving them
    through gloo's sockets (a 64 MB K/V block between two processes of a 2-core EPYC: 82 ms over gloo, 10 ms to
    publish here), and a lock file for the counter the forward's items are claimed from. One per group, kept between
    calls and grown when a call needs more bytes.
    CS149GPT_RING_SHM=0: gloo's transfers (the ranks must agree: _prepare checks it). Every decision that could
    differ between ranks (room, visibility of the peers' files, mapping) is taken together, by an all_reduce."""

    _of_group = weakref.WeakKeyDictionary()  # group -> _HostBlocks, or None where its ranks are not on one host
    # Publications under 1 MiB go over gloo: a publication's two barriers cost 0.8 ms (2-core EPYC), a 4 KB gloo
    # exchange 0.23 ms, a MiB 0.8 ms.
    min_bytes = 1 << 20

    def __init__(self, group, rank, world_size):
        # (the group weakly: the cache's key must not be kept alive by its value)
        self._group = weakref.ref(group) if group is not None else None
        self.rank, self.world_size = rank, world_size
        self.nbytes, self.storages, self.usable = 0, [], True
        self.lock = None  # an open file every rank of the group flocks around a claim (_grow makes it)

    @property
    def group(self):
        return self._group() if self._group is not None else None

    @classmethod
    def of(cls, group, rank: int, world_size: int, device) -> Optional["_HostBlocks"]:
        """The group's blocks, or None (CUDA, one rank, not gloo, ranks on several hosts, CS149GPT_RING_SHM=0)."""
        if device.type != "cpu" or world_size == 1 or not _shm_allowed() or dist.get_backend(group) != "gloo":
            return None
        g = group if group is not None else dist.group.WORLD
        if g not in cls._of_group:  # every rank of the group comes here in the same call
            hosts = [None] * world_size
            dist.all_gather_object(hosts, socket.gethostname(), group=group)
            cls._of_group[g] = cls(group, rank, world_size) if len(set(hosts)) == 1 else None
        return cls._of_group[g]

    def _all(self, flag: bool) -> bool:
        """flag on every rank of the group (an all_reduce of it)."""
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def _grow(self, nbytes: int) -> bool:
        """Every rank's buffer of nbytes, or False on every rank. Each rank creates its file with its pages
        allocated (posix_fallocate: a full /dev/shm is ENOSPC now, where a write past it later would be a SIGBUS),
        checks that every peer's file is there (ranks that share a hostname but not /dev/shm, as containers on the
        host's network, do not see them: then never again for this group), maps them all, and removes its own name
        once every rank has mapped it (the mappings stay; on any failure the name goes at once)."""
        token = [secrets.token_hex(8) if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=_global_rank(self.group, 0), group=self.group)
        paths = [f"/dev/shm/cs149gpt-ring-{token[0]}-{r}" for r in range(self.world_size)]
        lock_path = f"/dev/shm/cs149gpt-ring-{token[0]}-lock"
        self.storages, self.nbytes = [], 0  # (the smaller buffers' mappings go)
        self._close_lock()
        try:
            created = False
            try:
                fd = os.open(paths[self.rank], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                created = True
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
                self.lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
                self._lock_closer = weakref.finalize(self, os.close, self.lock)
                room = True
            except OSError:
                room = False
            if not self._all(room):
                self._close_lock()
                return False
            if not self._all(all(os.path.isfile(p) and os.path.getsize(p) == nbytes for p in paths)):
                self.usable = False
                self._close_lock()
                return False
            try:
                storages = [torch.UntypedStorage.from_file(p, shared=True, nbytes=nbytes) for p in paths]
                mapped = True
            except Exception:  # noqa: BLE001 (out of mappings or descriptors: decided together below)
                storages, mapped = [], False
            if not self._all(mapped):
                self._close_lock()
                return False
        finally:
            for path in [paths[self.rank]] * created + [lock_path] * (self.rank == 0):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        self.storages, self.nbytes = storages, nbytes
        return True

    def _close_lock(self) -> None:
        if self.lock is not None:
            self._lock_closer()
            self.lock = None

    def claim(self, counter: torch.Tensor) -> int:
        """counter[0]'s value, incremented by one (an int64 in shared memory; one rank at a time)."""
        import fcntl
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        try:
            i = int(counter[0])
            counter[0] = i + 1
        finally:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
        return i

    def views(self, r: int, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Rank r's published tensors, shaped as `like` (this rank's: every rank's are alike), in place."""
        if len({t.dtype for t in like}) != 1:
            raise TypeError("_HostBlocks: one dtype a publication (its offsets are in elements)")
        views, offset = [], 0
        for t in like:
            views.append(torch.empty(0, dtype=t.dtype).set_(self.storages[r], offset, t.shape))
            offset += t.numel()
        return views

    def publish(self, tensors: Sequence[torch.Tensor], what: str, who: str = "ring_attention", fill=None) -> bool:
        """This rank's tensors into its buffer, between two barriers: every peer is done with the last call's
        before they are overwritten, and every rank's are written before any is read. False (every rank alike)
        under min_bytes, or where /dev/shm has no room for them: the caller's transfers go over gloo.
        fill: fill(views) writes the values into this rank's views instead (tensors then give shapes and dtype only:
        meta tensors will do)."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if nbytes < self.min_bytes or not self.usable:  # (the same on every rank: the shapes agree)
            return False
        try:
            if nbytes > self.nbytes and not self._grow(nbytes):
                return False
            dist.barrier(group=self.group)
            own = self.views(self.rank, tensors)
            if fill is not None:
                fill(own)
            else:
                for view, t in zip(own, tensors):
                    view.copy_(t)
            dist.barrier(group=self.group)
        except Exception as e:  # (a timeout or a peer gone)
            raise RuntimeError(f"{who}: {what} (rank {self.rank} of {self.world_size}) failed: {e}") from e
        return True


# ------------------------------------------------------------------------------------------------- the ring
class _Ring:
    """What one call needs on every step: the group, the neighbours, the plan of kernel calls per source rank."""

    def __init__(self, group, rank, world_size, scale, causal, layout, nq, nk, host_blocks=None):
        self.group, self.rank, self.world_size, self.scale = group, rank, world_size, scale
        self.host_blocks = host_blocks  # _HostBlocks: the forward reads the blocks in shared memory
        self.next = _global_rank(group, (rank + 1) % world_size)
        self.prev = _global_rank(group, (rank - 1) % world_size)
        offset = _offset(causal, world_size, nq, nk)
        self.calls = _plan(layout, world_size, rank, nq, nk, offset)
        # The work-shared forward's plan (host_blocks): for each owner rank and each of its query chunks, the calls
        # against every source rank's block, in the chunk's rows.
        self.chunk_calls = {}
        if host_blocks is not None:
            for owner in range(world_size):
                for chunk in _chunks(layout, world_size, owner, nq):
                    self.chunk_calls[owner, chunk] = [
                        _block_calls([(0, chunk[1], chunk[2])], _chunks(layout, world_size, src, nk), offset)
                        for src in range(world_size)]

    def source(self, step: int) -> int:
        """Whose K/V block this rank holds at step (the blocks travel from rank r to r + 1)."""
        return (self.rank - step) % self.world_size

    def exchange(self, tensors: Sequence[torch.Tensor], tag: int):
        """Posts the send of tensors to the next rank and the receive of as many from the previous one; returns
        (handles, receive buffers)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag + i) for i, t in enumerate(received)]
        return dist.batch_isend_irecv(ops), received

    def wait(self, handles, what: str, step: int) -> None:
        try:
            for h in handles:
                h.wait()
        except Exception as e:  # (a timeout or a peer gone: which step, which transfer)
            raise RuntimeError(f"ring_attention: {what} at step {step} of {self.world_size} (rank {self.rank} sends "
                               f"to rank {self.next}, receives from rank {self.prev}) failed: {e}") from e


def _merge(out_acc, lse_acc, out_b, lse_b, fresh: bool) -> None:
    """out_acc, lse_acc (float32, in place) ← the softmax-weighted union of themselves and a block's (out_b, lse_b);
    fresh: no block has reached these rows yet, so the union is the block itself (a copy, not two passes)."""
    if fresh:
        out_acc.copy_(out_b)
        lse_acc.copy_(lse_b)
        return
    # One pass over the rows (csrc/kernels/merge.cpp, cuda/merge.cu): out_b read in its own dtype.
    torch.ops.cs149gpt.merge_partial_(out_acc, lse_acc, out_b, lse_b)


def _rows(t, lo, hi):
    return t[:, :, lo:hi]


class _Reached:
    """The row ranges (dim 2) of an accumulator that partials have been written into. Accumulators start
    uninitialised (torch.empty): a partial that is the first on all its rows is copied in (no fill, no second pass);
    rows get their initial value (0; lse −inf) only where a partial lands on them partly, or none ever does."""

    def __init__(self, n: int):
        self.n, self.spans = n, []

    def gaps(self, lo: int, hi: int) -> List[Tuple[int, int]]:
        """The parts of [lo, hi) no partial has reached."""
        gaps, at = [], lo
        for a, b in sorted(self.spans):
            if a >= hi:
                break
            if a > at:
                gaps.append((at, a))
            at = max(at, b)
        if at < hi:
            gaps.append((at, hi))
        return gaps

    def first(self, lo: int, hi: int, *accs_and_values) -> bool:
        """Marks [lo, hi) reached; True where no partial had reached any of it, else sets the rows of it no partial
        had reached to their initial values (pairs of accumulator, value) and returns False."""
        gaps = self.gaps(lo, hi)
        self.spans.append((lo, hi))
        if gaps == [(lo, hi)]:
            return True
        self._fill(gaps, accs_and_values)
        return False

    def finish(self, *accs_and_values) -> None:
        """The rows no partial reached: their initial values."""
        self._fill(self.gaps(0, self.n), accs_and_values)

    @staticmethod
    def _fill(gaps, accs_and_values) -> None:
        for a, b in gaps:
            for acc, value in zip(accs_and_values[::2], accs_and_values[1::2]):
                _rows(acc, a, b).fill_(value)


def _accumulators(q):
    """out and lse (float32, uninitialised) for q's rows, and the rows partials have reached (_Reached)."""
    return (torch.empty(q.shape, dtype=torch.float32, device=q.device),
            torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device), _Reached(q.shape[2]))


def _attend_block(q, k, v, calls, scale, out_acc, lse_acc, reached) -> None:
    """One K/V block's kernel calls (q_lo, q_hi, k_lo, k_hi, causal) on q's rows, each partial merged into out_acc,
    lse_acc (copied where no block has reached its rows yet; reached.finish gives the rows none reaches 0, −inf)."""
    for q_lo, q_hi, k_lo, k_hi, causal in calls:
        out_b, lse_b = torch.ops.cs149gpt.flash_attention(
            _rows(q, q_lo, q_hi), _rows(k, k_lo, k_hi), _rows(v, k_lo, k_hi), scale, causal)
        fresh = reached.first(q_lo, q_hi, out_acc, 0.0, lse_acc, -math.inf)
        _merge(_rows(out_acc, q_lo, q_hi), lse_acc[:, :, q_lo:q_hi], out_b, lse_b, fresh)


def _chunk_attention(q_rows, blocks, calls, scale):
    """One query chunk's (out float32, lse) against every source's K/V block, calls[src] merged in source order."""
    out_acc, lse_acc, reached = _accumulators(q_rows)
    for (k, v), block_calls in zip(blocks, calls):
        _attend_block(q_rows, k, v, block_calls, scale, out_acc, lse_acc, reached)
    reached.finish(out_acc, 0.0, lse_acc, -math.inf)
    return out_acc, lse_acc


def _ring_forward(q, k, v, ring: _Ring):
    """The ring's forward: step s computes the block of rank − s while the next one travels; returns (out, lse)."""
    out_acc, lse_acc, reached = _accumulators(q)
    kv = (k, v)
    for step in range(ring.world_size):
        if step + 1 < ring.world_size:  # the next block travels while this one is computed
            handles, incoming = ring.exchange(kv, _TAG_FWD)
        _attend_block(q, kv[0], kv[1], ring.calls[ring.source(step)], ring.scale, out_acc, lse_acc, reached)
        if step + 1 < ring.world_size:
            ring.wait(handles, "the forward's K/V transfer", step + 1)
            kv = tuple(incoming)
    reached.finish(out_acc, 0.0, lse_acc, -math.inf)
    return out_acc.to(q.dtype), lse_acc


def _shared_forward(q, k, v, ring: _Ring, shared: "_HostBlocks"):
    """The forward of ranks that share one host (gloo, shared memory): every rank publishes q, k and v, then the
    ranks take work items (a query chunk of some rank, one batch element, a slice of its kv heads; against every
    block) from a counter in shared memory, heaviest first, and write each item's rows into its owner's out and lse
    there. A rank that runs slower (a busy core, a neighbour's cache traffic) takes fewer items, as the threads of one
    process do, where a ring's steps would wait for it. Returns this rank's (out, lse), or None where shared memory has
    no room."""
    b_, h_, nq, _ = q.shape
    hkv = k.shape[1]
    group = h_ // hkv
    cnt = 8 // q.element_size()  # an int64 counter, in q's dtype's elements
    lse_like = torch.empty(-(-b_ * h_ * nq * 4 // q.element_size()), dtype=q.dtype, device="meta")
    like = (torch.empty(cnt, dtype=q.dtype, device="meta"), q, k, v, q, lse_like)

    def fill(views):
        for view, t in zip(views[1:4], (q, k, v)):
            view.copy_(t)
        if ring.rank == 0:
            views[0].view(torch.int64).zero_()

    if not shared.publish(like, "the forward's publication of Q, K and V in shared memory", fill=fill):
        return None
    views = [shared.views(r, like) for r in range(ring.world_size)]
    counter = views[0][0].view(torch.int64)
    # Items: (owner, chunk, batch element, kv heads [hk, hk + heads)), at least 16 a rank where the kv heads divide
    # that finely
    heads = hkv
    while heads > 1 and b_ * (hkv // heads) * len(ring.chunk_calls) < 16 * ring.world_size:
        heads = next(h for h in range(heads - 1, 0, -1) if hkv % h == 0)
    items = []
    for (owner, chunk), calls in ring.chunk_calls.items():
        work = sum((c[1] - c[0]) * (c[3] - c[2]) * (0.5 if c[4] != "none" else 1.0) for cs in calls for c in cs)
        for b in range(b_):
            for hk in range(0, hkv, heads):
                items.append((-work, owner, chunk, b, hk))
    items.sort(key=lambda item: item[0])  # heaviest first (ties in a fixed order: the same list on every rank)
    i = shared.claim(counter)
    while i < len(items):
        _, owner, chunk, b, hk = items[i]
        lo, hi, qh = chunk[0], chunk[0] + chunk[2], slice(hk * group, (hk + heads) * group)
        q_rows = views[owner][1][b:b + 1, qh, lo:hi]
        blocks = [(views[src][2][b:b + 1, hk:hk + heads], views[src][3][b:b + 1, hk:hk + heads])
                  for src in range(ring.world_size)]
        out_c, lse_c = _chunk_attention(q_rows, blocks, ring.chunk_calls[owner, chunk], ring.scale)
        views[owner][4][b:b + 1, qh, lo:hi].copy_(out_c)
        views[owner][5].view(torch.float32).view(b_, h_, nq)[b:b + 1, qh, lo:hi].copy_(lse_c)
        i = shared.claim(counter)
    try:
        dist.barrier(group=shared.group)  # every item written before any rank reads its rows
    except Exception as e:  # (a timeout or a peer gone)
        raise RuntimeError(f"ring_attention: the work-shared forward's end (rank {ring.rank} of {ring.world_size}) "
                           f"failed: {e}") from e
    mine = views[ring.rank]
    return mine[4].clone(), mine[5].view(torch.float32).view(b_, h_, nq).clone()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        k, v = k.contiguous(), v.contiguous()
        shared = ring.host_blocks
        done = _shared_forward(q.contiguous(), k, v, ring, shared) if shared is not None else None
        out, lse_acc = done if done is not None else _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse_acc)
        return out, lse_acc

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        dout = dout.contiguous()
        # float32 accumulators, uninitialised (_Reached: a block's partial copied where it is the first)
        dq, dq_reached = torch.empty(q.shape, dtype=torch.float32, device=q.device), _Reached(q.shape[2])
        # The accumulator of the block held now: ours at step 0, then the one that arrives with its block.
        dkv = (torch.empty(k.shape, dtype=torch.float32, device=k.device),
               torch.empty(v.shape, dtype=torch.float32, device=v.device))
        own_reached = _Reached(k.shape[2])
        kv, grad_handles = (k, v), None
        for step in range(ring.world_size):
            if step + 1 < ring.world_size:
                kv_handles, kv_incoming = ring.exchange(kv, _TAG_BWD_KV)
            blocks = []
            for q_lo, q_hi, k_lo, k_hi, causal in ring.calls[ring.source(step)]:
                dq_b, dk_b, dv_b = torch.ops.cs149gpt.flash_attention_backward(
                    _rows(dout, q_lo, q_hi), _rows(q, q_lo, q_hi), _rows(kv[0], k_lo, k_hi),
                    _rows(kv[1], k_lo, k_hi), _rows(out, q_lo, q_hi), lse[:, :, q_lo:q_hi], ring.scale, causal)
                if dq_reached.first(q_lo, q_hi, dq, 0.0):
                    _rows(dq, q_lo, q_hi).copy_(dq_b)
                else:
                    _rows(dq, q_lo, q_hi).add_(dq_b)
                blocks.append((k_lo, k_hi, dk_b, dv_b))
            if grad_handles is not None:  # this block's accumulator, from the previous rank
                ring.wait(grad_handles, "the backward's dK/dV transfer", step)
                dkv = tuple(grad_incoming)
            for k_lo, k_hi, dk_b, dv_b in blocks:
                if step == 0 and own_reached.first(k_lo, k_hi, dkv[0], 0.0, dkv[1], 0.0):
                    _rows(dkv[0], k_lo, k_hi).copy_(dk_b)
                    _rows(dkv[1], k_lo, k_hi).copy_(dv_b)
                else:
                    _rows(dkv[0], k_lo, k_hi).add_(dk_b)
                    _rows(dkv[1], k_lo, k_hi).add_(dv_b)
            if step == 0:  # (before it travels: the ranks after us add to every row)
                own_reached.finish(dkv[0], 0.0, dkv[1], 0.0)
            if ring.world_size > 1:  # on to the next rank; after the last step it arrives at its owner
                grad_handles, grad_incoming = ring.exchange(dkv, _TAG_BWD_GRAD)
            if step + 1 < ring.world_size:
                ring.wait(kv_handles, "the backward's K/V transfer", step + 1)
                kv = tuple(kv_incoming)
        if grad_handles is not None:
            ring.wait(grad_handles, "the backward's dK/dV return", ring.world_size)
            dkv = tuple(grad_incoming)
        dq_reached.finish(dq, 0.0)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _prepare(q, k, v, group, mesh_dim, is_causal, scale, layout, who, heads_per_rank=False, then=None):
    """The checks every algorithm makes, then the agreement of every rank (_agree): (group, rank, world size, q, k,
    v (in autocast's dtype where it is on), causal mode, scale). heads_per_rank: the query heads must divide over
    the ranks (ulysses_attention). then: (group, world size) of a second agreement that every rank makes after this
    group's, fine or not (usp_attention: the Ulysses group, then the ring group, whose rank then holds the group's
    whole local sequence: an error anywhere in the mesh raises on every rank)."""
    group, rank, world_size = _resolve_group(group, mesh_dim, who)
    error = _local_error(q, k, v, who)
    if error is None and heads_per_rank and q.shape[1] % world_size:
        error = ValueError(f"{who}: q's {q.shape[1]} heads do not divide over the group's {world_size} ranks (each "
                           "rank attends over the whole sequence for H / W of them)")
    if error is None and torch.is_autocast_enabled(q.device.type):  # torch SDPA's rule: inputs in autocast's dtype
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    causal = _causal_mode(is_causal)
    if error is None and causal is None:
        error = ValueError(f"{who}: is_causal must be False, True, 'top_left' or 'bottom_right'; got "
                           f"{is_causal!r}")
    if error is None and layout not in LAYOUTS:
        error = ValueError(f"{who}: layout must be one of {', '.join(map(repr, LAYOUTS))}; got {layout!r}")
    span = world_size if then is not None else 1  # (usp_attention: the ring's local lengths are the group's)
    if error is None and layout == "zigzag" and (q.shape[2] * span % 2 or k.shape[2] * span % 2):
        times = f" times the Ulysses group's {span} ranks" if span > 1 else ""
        error = ValueError(f"{who}: layout='zigzag' needs even local lengths{times} (two chunks a rank); got "
                           f"q.shape[2] = {q.shape[2]}, k.shape[2] = {k.shape[2]}")
    if error is None and scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        error = ValueError(f"{who}: scale must be a finite float or None, got {scale!r}")
    if error is None:
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        fields = [*q.shape[:2], k.shape[1], q.shape[2], k.shape[2], q.shape[3], _DTYPES.index(q.dtype),
                  LAYOUTS.index(layout), ("none", "top_left", "bottom_right").index(causal),
                  struct.unpack("<q", struct.pack("<d", scale))[0], int(needs_grad), int(_shm_allowed()),
                  int(q.device.type == "cuda")]
        device = q.device
    else:
        fields = [0] * len(_FIELDS)
        # (no tensor: the CPU, which _agree trades for CUDA where the group has no CPU backend)
        device = next((t.device for t in (q, k, v) if isinstance(t, torch.Tensor)), torch.device("cpu"))
    if then is None:
        _agree(group, world_size, device, error, fields, who)
    else:
        # The groups must form a mesh: one ring rank across a Ulysses group, one Ulysses rank across a ring group
        ring_rank = dist.get_rank(then[0])
        try:
            _agree(group, world_size, device, error, fields, who,
                   [("rank in the ring group (ring_group)", ring_rank), ("ring group size", then[1])])
            error = None
        except Exception as e:  # noqa: BLE001 (the second agreement carries it to the other groups' ranks)
            error = e
        _agree(*then, device, error, fields, who,
               [("rank in the Ulysses group (ulysses_group)", rank), ("Ulysses group size", world_size)])
    return group, rank, world_size, q, k, v, causal, scale


@torch.compiler.disable  # a graph break: point-to-point transfers cannot be traced
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, mesh_dim=None,
                   is_causal: Union[bool, str] = False, scale: Optional[float] = None, layout: str = "contiguous",
                   return_lse: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """softmax(scale · Q Kᵀ [+ causal mask]) V over a sequence sharded across the ranks of group (see the module's
    help for the algorithm, layouts, masks and errors). Every rank of the group must call it with the same shapes.

    Args:
        q: (B, H, n_q, d) this rank's queries (n_q = N_q / W, in `layout` order).
        k, v: (B, Hkv, n_k, d) this rank's keys and values; Hkv divides H (GQA, never expanded); n_k may differ
            from n_q (the same on every rank).
        group: a ProcessGroup (gloo for CPU tensors, NCCL for CUDA ones), None for the default group, or a DeviceMesh
            (mesh_dim: which dimension, for an n-D mesh).
        is_causal: False; True or "top_left" (query i sees keys j <= i, global positions); "bottom_right" (query i
            sees keys j <= i + N_k − N_q).
        scale: multiplies q·k; None means 1/sqrt(d).
        layout: "contiguous" or "zigzag", how the sequence was sharded (shard_sequence's layout).
        return_lse: also return lse, (B, H, n_q) float32: the logsumexp of each local query row over the whole
            sequence's visible keys (not differentiable).

    Returns:
        out (B, H, n_q, d) in q's dtype (differentiable in q, k and v), or (out, lse).
    """
    group, rank, world_size, q, k, v, causal, scale = _prepare(q, k, v, group, mesh_dim, is_causal, scale, layout,
                                                               "ring_attention")
    ring = _Ring(group, rank, world_size, scale, causal, layout, q.shape[2], k.shape[2],
                 _HostBlocks.of(group, rank, world_size, q.device))
    out, lse = _RingAttention.apply(q, k, v, ring)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------------------- all-to-all
def _all_to_all(group, parts: List[List[torch.Tensor]], what: str) -> List[torch.Tensor]:
    """Rank j gets the message torch.cat(parts[j], 1); returns what each rank i sent here, in rank order (messages
    share one shape). One all_to_all_single over the messages, concatenated straight into one buffer: gloo has no
    list all_to_all in every torch this runs on. On one host with gloo, through shared memory instead
    (_HostBlocks): every rank concatenates its messages into its buffer there and reads the ones addressed to it in
    place: views, valid until this rank's next publication (the callers copy them out at once)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    first = parts[0]
    shape = list(first[0].shape)
    shape[1] = sum(p.shape[1] for p in first)
    like = [torch.empty(shape, dtype=first[0].dtype, device="meta")] * world_size
    shared = _HostBlocks.of(group, rank, world_size, first[0].device)

    def fill(views):
        for view, message in zip(views, parts):
            torch.cat(message, 1, out=view)

    if shared is not None and shared.publish(like, what, "ulysses_attention", fill=fill):
        return [shared.views(i, like)[rank] for i in range(world_size)]
    stacked = torch.empty([world_size] + shape, dtype=first[0].dtype, device=first[0].device)
    fill(stacked.unbind(0))
    received = torch.empty_like(stacked)
    try:
        dist.all_to_all_single(received, stacked, group=group)
    except Exception as e:  # (a timeout or a peer gone: which exchange)
        raise RuntimeError(f"ulysses_attention: {what} failed: {e}") from e
    return list(received.unbind(0))


def _by_length(fn):
    """fn over the tensors in groups of one sequence length (q's may differ from k and v's), in their order."""
    def apply(group, world_size, layout, tensors, what):
        out = [None] * len(tensors)
        for n in dict.fromkeys(t.shape[2] for t in tensors):
            idx = [i for i, t in enumerate(tensors) if t.shape[2] == n]
            for i, r in zip(idx, fn(group, world_size, layout, [tensors[i] for i in idx], what)):
                out[i] = r
        return out
    return apply


@_by_length
def _seq_to_heads(group, world_size: int, layout: str, tensors: Sequence[torch.Tensor], what: str):
    """Each (B, Ht, n, d) tensor sharded over the sequence → (B, Ht / W, W·n, d): this rank's share of the heads
    over the whole sequence in order. Tensors of one length travel in one all-to-all (a message a pair of ranks)."""
    heads = [t.shape[1] // world_size for t in tensors]
    parts = [[t[:, j * h:(j + 1) * h] for t, h in zip(tensors, heads)] for j in range(world_size)]
    received = [r.split(heads, 1) for r in _all_to_all(group, parts, what)]
    return [unshard_sequence([received[i][t] for i in range(world_size)], 2, layout=layout)
            for t in range(len(tensors))]


@_by_length
def _heads_to_seq(group, world_size: int, layout: str, tensors: Sequence[torch.Tensor], what: str):
    """The inverse of _seq_to_heads: (B, Ht / W, N, d) → (B, Ht, N / W, d), this rank's tokens of every head."""
    heads = [t.shape[1] for t in tensors]
    parts = [[shard_sequence(t, 2, world_size=world_size, rank=j, layout=layout) for t in tensors]
             for j in range(world_size)]
    received = [r.split(heads, 1) for r in _all_to_all(group, parts, what)]
    return [torch.cat([received[i][t] for i in range(world_size)], 1) for t in range(len(tensors))]


class _Exchange(torch.autograd.Function):
    """One of the two all-to-alls (to_heads: _seq_to_heads, else _heads_to_seq); its gradient is the other one on the
    incoming gradients. names: what travels, for the error message ("q, k, v"; the backward's "dq, dk, dv")."""

    @staticmethod
    def forward(ctx, to_heads, names, group, world_size, layout, *tensors):
        ctx.args = (to_heads, names, group, world_size, layout)
        exchange = _seq_to_heads if to_heads else _heads_to_seq
        return tuple(exchange(group, world_size, layout, tensors, f"the forward's all-to-all of {names}"))

    @staticmethod
    def backward(ctx, *grads):
        to_heads, names, group, world_size, layout = ctx.args
        exchange = _heads_to_seq if to_heads else _seq_to_heads
        grads = [g.contiguous() for g in grads]
        what = "the backward's all-to-all of " + ", ".join("d" + n for n in names.split(", "))
        return (None,) * 5 + tuple(exchange(group, world_size, layout, grads, what))


@torch.compiler.disable  # a graph break: collectives on a process group are not traced here
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, mesh_dim=None,
                      is_causal: Union[bool, str] = False, scale: Optional[float] = None, layout: str = "contiguous",
                      return_lse: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """ring_attention's contract by the all-to-all (DeepSpeed-Ulysses) route: one all-to-all turns every rank's slice
    of the sequence for all heads into the whole sequence for H / W heads, each rank runs one cs149gpt.attention
    call on that, and a second all-to-all returns every rank its own tokens (the backward: the same two exchanges in
    reverse). Two all-to-alls each way (q, k and v stacked into one, three where q's length differs from k's; then
    out), of the local sizes, instead of the ring's W − 1 K/V hops; the kernel sees the whole sequence (no merge, no
    plan, one causal call, so its result is one process's). q's heads must divide over the ranks; k and v's heads
    are repeated up to a multiple of W where they do not (GQA with Hkv < W). Arguments, layouts, causal modes,
    checks and errors as ring_attention's; a failed or timed-out exchange raises RuntimeError naming it."""
    group, rank, world_size, q, k, v, causal, scale = _prepare(q, k, v, group, mesh_dim, is_causal, scale, layout,
                                                               "ulysses_attention", heads_per_rank=True)
    repeat = world_size // math.gcd(k.shape[1], world_size)  # kv heads up to a multiple of W (H is one already)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    if world_size == 1:
        qh, kh, vh = q, k, v
    else:
        qh, kh, vh = _Exchange.apply(True, "q, k, v", group, world_size, layout, q.contiguous(), k.contiguous(),
                                     v.contiguous())
    mode = {"none": False, "top_left": True, "bottom_right": "bottom_right"}[causal]
    out, lse = cs149gpt.attention(qh, kh, vh, is_causal=mode, scale=scale, return_lse=True)
    if world_size == 1:
        return (out, lse) if return_lse else out
    (out,) = _Exchange.apply(False, "out", group, world_size, layout, out.contiguous())
    if not return_lse:
        return out
    with torch.no_grad():
        lse = _heads_to_seq(group, world_size, layout, [lse.unsqueeze(-1).contiguous()],
                            "the all-to-all of lse")[0].squeeze(-1)
    return out, lse


@torch.compiler.disable  # a graph break: collectives on a process group are not traced here
def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh=None, ring_group=None,
                  ulysses_group=None, is_causal: Union[bool, str] = False, scale: Optional[float] = None,
                  layout: str = "contiguous", return_lse: bool = False
                  ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The two routes combined (USP, "unified sequence parallelism"): W = R·U ranks in R ring groups' worth of U
    Ulysses groups. Within a Ulysses group an all-to-all turns each rank's tokens for all heads into the group's
    tokens for H / U heads (ulysses_attention's exchange); ring_attention then runs over the ring group (the ranks
    holding the same heads in the other Ulysses groups) on those tokens, and a second all-to-all returns every rank
    its own tokens. The all-to-alls stay among U ranks (one node's fast links) while the ring's K/V hops cross the
    R groups; heads need only divide over U, not W.

    The tokens: the sequence is sharded over the ring groups as shard_sequence(x, 2, world_size=R, rank=r,
    layout=layout) gives them (zigzag balances the causal work), and that share over the Ulysses group contiguously,
    so rank (r, u) holds shard_sequence(shard_sequence(x, 2, world_size=R, rank=r, layout=layout), 2, world_size=U,
    rank=u) (and those tokens' shard_positions, sliced the same way), with r = dist.get_rank(ring_group) and
    u = dist.get_rank(ulysses_group): a rank's index in each group (for a DeviceMesh, its groups' ranks, which are
    its coordinates where the mesh's ranks increase along each dimension). The groups must form a mesh (every rank of
    a Ulysses group has one r, every rank of a ring group one u): the checks refuse others.

    Args:
        q, k, v: this rank's slices, (B, H, n_q, d) and (B, Hkv, n_k, d); H divides over U; k and v's heads are
            repeated up to a multiple of U where they do not divide over it.
        mesh: a 2-D DeviceMesh, dimension 0 the ring and dimension 1 Ulysses; or ring_group and ulysses_group
            (ProcessGroups: the ranks of each ring group hold the same share of the heads after the all-to-all).
        is_causal, scale, layout, return_lse: as ring_attention's (layout: the ring groups' sharding).

    Returns:
        out (B, H, n_q, d) in q's dtype (differentiable in q, k and v), or (out, lse (B, H, n_q) float32).

    Checks and errors as ring_attention's, agreed first within the Ulysses group and then within the ring group, so
    that a bad input on any rank raises on every rank of the mesh."""
    if mesh is not None:
        if ring_group is not None or ulysses_group is not None:
            raise ValueError("usp_attention: pass mesh, or ring_group and ulysses_group, not both")
        if getattr(mesh, "ndim", None) != 2:
            raise ValueError(f"usp_attention: mesh must be a 2-D DeviceMesh (ring, Ulysses), got {mesh!r}")
        ring_group, ulysses_group = mesh.get_group(0), mesh.get_group(1)
    elif ring_group is None or ulysses_group is None:
        raise ValueError("usp_attention: pass mesh (a 2-D DeviceMesh), or both ring_group and ulysses_group")
    for name, g in (("ring_group", ring_group), ("ulysses_group", ulysses_group)):
        if getattr(g, "ndim", 1) != 1:
            raise ValueError(f"usp_attention: {name} is a {g.ndim}-D DeviceMesh: pass it as mesh= (dimension 0 the "
                             "ring, 1 Ulysses), or a ProcessGroup (or 1-D DeviceMesh) for each")
    ring = _resolve_group(ring_group, None, "usp_attention")
    group, _, world_size, q, k, v, causal, scale = _prepare(
        q, k, v, ulysses_group, None, is_causal, scale, layout, "usp_attention", heads_per_rank=True,
        then=(ring[0], ring[2]))
    repeat = world_size // math.gcd(k.shape[1], world_size)  # kv heads up to a multiple of U (as ulysses_attention)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    if world_size > 1:
        q, k, v = _Exchange.apply(True, "q, k, v", group, world_size, "contiguous", q.contiguous(), k.contiguous(),
                                  v.contiguous())
    # The ring over the ring group, without ring_attention's own agreement: both groups' checks above cover it
    ring_group, ring_rank, ring_size = ring
    plan = _Ring(ring_group, ring_rank, ring_size, scale, causal, layout, q.shape[2], k.shape[2],
                 _HostBlocks.of(ring_group, ring_rank, ring_size, q.device))
    out, lse = _RingAttention.apply(q, k, v, plan)
    if world_size > 1:
        (out,) = _Exchange.apply(False, "out", group, world_size, "contiguous", out.contiguous())
        if return_lse:
            with torch.no_grad():
                lse = _heads_to_seq(group, world_size, "contiguous", [lse.unsqueeze(-1).contiguous()],
                                    "the all-to-all of lse")[0].squeeze(-1)
    return (out, lse) if return_lse else out
