"""cs149gpt.distributed: ring attention over 2 and 4 gloo processes against one process on the whole sequence.

Each world size is one spawn of W processes that run every case (the processes' start-up dominates on a small
machine); rank 0 sends the unsharded results back and the tests compare them here with cs149gpt.attention on the
whole sequence and with a float64 reference written out in plain torch.
"""
import io
import math
import multiprocessing
import os
import queue as queue_module
import time
import zlib
from datetime import timedelta

import pytest
import torch

import cs149gpt
from cs149gpt import distributed as cp

JOIN_SECONDS = 120  # a hang fails the test instead of the suite


# ------------------------------------------------------------------------------------------------- the cases
def case(name, *, dtype=torch.float32, b=1, h=4, hkv=2, nq=32, nk=32, d=16, causal=False, layout="contiguous",
         repeat=False, poison=False):
    return dict(name=name, dtype=dtype, b=b, h=h, hkv=hkv, nq=nq, nk=nk, d=d, causal=causal, layout=layout,
                repeat=repeat, poison=poison)


CASES = {
    2: [case("full_contiguous_gqa"),
        case("causal_contiguous", hkv=4, causal=True),
        case("causal_zigzag_gqa", causal=True, layout="zigzag", repeat=True),
        case("causal_zigzag_bf16", dtype=torch.bfloat16, causal=True, layout="zigzag", repeat=True),
        case("bottom_right_zigzag_nq_lt_nk", nq=16, nk=24, causal="bottom_right", layout="zigzag"),
        case("bottom_right_contiguous_nq_gt_nk", nq=24, nk=16, causal="bottom_right"),
        case("top_left_zigzag_nq_gt_nk", nq=24, nk=16, causal=True, layout="zigzag"),
        case("full_zigzag_nq_ne_nk_bf16", dtype=torch.bfloat16, nq=12, nk=20, layout="zigzag"),
        case("nonfinite_causal_zigzag", causal=True, layout="zigzag", poison=True),
        case("bottom_right_contiguous_batch2_nq_gt_nk", b=2, h=6, hkv=3, nq=24, nk=16, causal="bottom_right")],
    4: [case("causal_zigzag_gqa", causal=True, layout="zigzag", repeat=True),
        case("causal_contiguous_bf16", dtype=torch.bfloat16, causal=True),
        case("bottom_right_contiguous_nq_lt_nk", nq=16, nk=24, causal="bottom_right"),
        case("top_left_zigzag_nq_lt_nk_mqa", hkv=1, nq=16, nk=32, causal=True, layout="zigzag")],
    3: [case("causal_zigzag_longer", h=8, nq=384, nk=384, d=64, causal=True, layout="zigzag"),
        case("bottom_right_zigzag_bf16", dtype=torch.bfloat16, h=8, hkv=8, nq=192, nk=384, d=64,
             causal="bottom_right", layout="zigzag"),
        case("full_contiguous_odd_lengths", nq=63, nk=45)],
}


# NCCL on CUDA (one process a GPU; skipped without enough GPUs): the CUDA kernels take bf16/fp16 at head dim 64/128
CUDA_CASES = {
    2: [case("cuda_causal_zigzag_gqa", dtype=torch.bfloat16, h=8, hkv=2, nq=512, nk=512, d=64, causal=True,
             layout="zigzag", repeat=True),
        case("cuda_full_contiguous", dtype=torch.bfloat16, h=4, hkv=4, nq=256, nk=256, d=128),
        case("cuda_bottom_right_nq_lt_nk_fp16", dtype=torch.float16, h=4, hkv=2, nq=256, nk=384, d=64,
             causal="bottom_right", layout="zigzag")],
    4: [case("cuda_causal_zigzag_gqa", dtype=torch.bfloat16, h=8, hkv=2, nq=1024, nk=1024, d=128, causal=True,
             layout="zigzag", repeat=True),
        case("cuda_causal_contiguous_fp16", dtype=torch.float16, h=4, hkv=4, nq=512, nk=512, d=64, causal=True)],
}


def inputs(c):
    g = torch.Generator().manual_seed(zlib.crc32(c["name"].encode()))  # the same in every process
    q = torch.randn(c["b"], c["h"], c["nq"], c["d"], generator=g).to(c["dtype"])
    k = torch.randn(c["b"], c["hkv"], c["nk"], c["d"], generator=g).to(c["dtype"])
    v = torch.randn(c["b"], c["hkv"], c["nk"], c["d"], generator=g).to(c["dtype"])
    dout = torch.randn(c["b"], c["h"], c["nq"], c["d"], generator=g).to(c["dtype"])
    if c["poison"]:  # +inf in query 0 (a NaN or 0 row); NaN in the last key, which only the last query sees
        q[:, :, 0, 0] = math.inf
        k[:, :, -1], v[:, :, -1] = math.nan, math.nan
    return q, k, v, dout


# ------------------------------------------------------------------------------------------------- the processes
def ring_run(c, q, k, v, dout, algorithm=None):
    """One distributed call on this rank's slices (cp.ring_attention, or cp.ulysses_attention); the whole
    sequence's out, lse and gradients."""
    shard = dict(layout=c["layout"])
    ql, kl, vl = (cp.shard_sequence(t, 2, **shard).detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = (algorithm or cp.ring_attention)(ql, kl, vl, is_causal=c["causal"], layout=c["layout"],
                                                 return_lse=True)
    out.backward(cp.shard_sequence(dout, 2, **shard))
    return {name: cp.unshard_sequence(t, 2, **shard)
            for name, t in (("out", out), ("lse", lse), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}


def usp_run(c, q, k, v, dout, rank, world_size, groups):
    """cp.usp_attention on a (ring R = 2) x (Ulysses U = W / 2) mesh of the W ranks (rank = r·U + u): this rank's
    tokens are part u (contiguous) of ring share r (c's layout); the whole sequence's out, lse and gradients."""
    ring_groups, ulysses_groups, mesh = groups
    u_size = world_size // 2
    r, u = divmod(rank, u_size)

    def shard(t):
        share = cp.shard_sequence(t, 2, world_size=2, rank=r, layout=c["layout"])
        return cp.shard_sequence(share, 2, world_size=u_size, rank=u)

    def unshard(t):
        share = cp.unshard_sequence(t, 2, ulysses_groups[r])
        return cp.unshard_sequence(share, 2, ring_groups[u], layout=c["layout"])

    ql, kl, vl = (shard(t).detach().clone().requires_grad_() for t in (q, k, v))
    route = dict(mesh=mesh) if mesh is not None else dict(ring_group=ring_groups[u], ulysses_group=ulysses_groups[r])
    out, lse = cp.usp_attention(ql, kl, vl, is_causal=c["causal"], layout=c["layout"], return_lse=True, **route)
    out.backward(shard(dout))
    return {name: unshard(t) for name, t in
            (("out", out), ("lse", lse), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}


def error_cases(rank):
    """(name, q, k, v, kwargs) where rank 1 differs from the others."""
    x = torch.randn(1, 2, 8, 16)
    odd = rank == 1
    return [("disagree_causal", x, x, x, dict(is_causal=odd)),
            ("disagree_length", x, x[:, :, :6] if odd else x, x[:, :, :6] if odd else x, {}),
            ("bad_local_rank", x[0] if odd else x, x, x, {}),
            ("bad_local_heads", x, torch.randn(1, 3, 8, 16) if odd else x, torch.randn(1, 3, 8, 16) if odd else x, {})]


def worker(rank, world_size, store_path, results, device="cpu", backend=None):
    try:
        torch.set_num_threads(1)
        cp._HostBlocks.min_bytes = 0  # the small cases through shared memory too
        cuda = device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        store = torch.distributed.FileStore(store_path, world_size)
        torch.distributed.init_process_group(backend or ("nccl" if cuda else "gloo"), store=store, rank=rank,
                                             world_size=world_size, timeout=timedelta(seconds=60))
        for c in (CUDA_CASES if cuda else CASES)[world_size]:
            q, k, v, dout = (t.to(device) for t in inputs(c))
            for algorithm, suffix in ((cp.ring_attention, ""), (cp.ulysses_attention, "/ulysses")):
                if algorithm is cp.ulysses_attention and c["h"] % world_size:
                    continue  # Ulysses spreads the query heads over the ranks
                got = ring_run(c, q, k, v, dout, algorithm)
                got = {name: t.cpu() for name, t in got.items()}
                if c["repeat"]:  # the same call again: the same bits (on the CPU, whichever rank took which item)
                    again = ring_run(c, q, k, v, dout, algorithm)
                    got["same_bits"] = torch.tensor(all(torch.equal(got[n], again[n].cpu()) for n in again))
                    if not cuda:  # and with the forward's K/V over gloo instead of shared memory: the same values
                        blocks = cp._HostBlocks._of_group.get(torch.distributed.group.WORLD)
                        got["shared_memory"] = torch.tensor(blocks is not None and blocks.nbytes > 0)
                        os.environ["CS149GPT_RING_SHM"] = "0"
                        over_gloo = ring_run(c, q, k, v, dout, algorithm)
                        os.environ.pop("CS149GPT_RING_SHM")
                        got.update({f"gloo {n}": t for n, t in over_gloo.items()})
                if rank == 0:
                    buffer = io.BytesIO()
                    torch.save(got, buffer)
                    results.put(("case", c["name"] + suffix, rank, buffer.getvalue()))
        if world_size == 4:
            # usp_attention on 2 ring groups x 2 Ulysses groups (every rank makes every group, in one order), and
            # once through a 2-D DeviceMesh
            ring_groups = [torch.distributed.new_group([u, u + 2]) for u in range(2)]
            ulysses_groups = [torch.distributed.new_group([2 * r, 2 * r + 1]) for r in range(2)]
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(device, (2, 2))
            for c in (CUDA_CASES if cuda else CASES)[4]:
                q, k, v, dout = (t.to(device) for t in inputs(c))
                got = usp_run(c, q, k, v, dout, rank, world_size, (ring_groups, ulysses_groups, None))
                got = {name: t.cpu() for name, t in got.items()}
                if c["repeat"]:
                    via_mesh = usp_run(c, q, k, v, dout, rank, world_size, (ring_groups, ulysses_groups, mesh))
                    got["same_bits"] = torch.tensor(all(torch.equal(got[n], via_mesh[n].cpu()) for n in via_mesh))
                if rank == 0:
                    buffer = io.BytesIO()
                    torch.save(got, buffer)
                    results.put(("case", c["name"] + "/usp", rank, buffer.getvalue()))
            # A bad input on rank 3 only (3 query heads do not divide over its Ulysses group): every rank raises,
            # the ranks of the other Ulysses group too (the ring group's agreement carries it)
            x = torch.randn(1, 3 if rank == 3 else 4, 8, 16, device=device)
            try:
                cp.usp_attention(x, x, x, ring_group=ring_groups[rank % 2], ulysses_group=ulysses_groups[rank // 2])
                results.put(("error", "usp_bad_heads", rank, "no error"))
            except Exception as e:  # noqa: BLE001
                results.put(("error", "usp_bad_heads", rank, f"{type(e).__name__}: {e}"))
            # Groups that do not form a mesh (ring groups {0, 3}, {1, 2}: each pairs Ulysses ranks 0 and 1)
            crossed = [torch.distributed.new_group([0, 3]), torch.distributed.new_group([1, 2])]
            try:
                y = torch.randn(1, 4, 8, 16, device=device)
                cp.usp_attention(y, y, y, ring_group=crossed[0 if rank in (0, 3) else 1],
                                 ulysses_group=ulysses_groups[rank // 2])
                results.put(("error", "usp_not_a_mesh", rank, "no error"))
            except Exception as e:  # noqa: BLE001
                results.put(("error", "usp_not_a_mesh", rank, f"{type(e).__name__}: {e}"))
        if world_size == 2 and cuda:
            # Ranks that disagree on CUDA tensors: raised on both, by the agreement (over the group's CPU backend
            # where it has one, else NCCL on a side stream)
            x = torch.randn(1, 2, 8, 16)
            on = "cpu" if rank == 1 else device  # rank 1's tensors on the CPU
            for name, q, k, v, kwargs in error_cases(rank)[:2] + [("disagree_device", x, x, x, {})]:
                try:
                    to = on if name == "disagree_device" else device
                    cp.ring_attention(q.to(to), k.to(to), v.to(to), **kwargs)
                    results.put(("error", name, rank, "no error"))
                except Exception as e:  # noqa: BLE001
                    results.put(("error", name, rank, f"{type(e).__name__}: {e}"))
            results.put(("error", "host_agreement", rank, cp._host_collectives(torch.distributed.group.WORLD)))
        if world_size == 2 and not cuda:
            # Which operators a causal zigzag forward runs (torch.profiler), summed over the ranks
            xp = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(rank))
            with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                cp.ring_attention(xp, xp, xp, is_causal=True, layout="zigzag")
            counts = {e.key: e.count for e in prof.key_averages()}
            results.put(("error", "ops", rank, [counts.get(op, 0) for op in (
                "cs149gpt::flash_attention", "cs149gpt::merge_partial_", "aten::addcmul_")]))
            # A slow rank (rank 1 waits 0.2 s before each item it takes): rank 0 takes the other items, and the
            # result is the balanced run's
            xs = torch.randn(1, 4, 32, 16, generator=torch.Generator().manual_seed(rank))
            with torch.no_grad():
                balanced = cp.ring_attention(xs, xs, xs, is_causal=True, layout="zigzag")
            real_chunk, taken = cp._chunk_attention, []

            def chunk_attention(*args):
                taken.append(1)
                if rank == 1:
                    time.sleep(0.2)
                return real_chunk(*args)

            cp._chunk_attention = chunk_attention
            try:
                with torch.no_grad():
                    slow = cp.ring_attention(xs, xs, xs, is_causal=True, layout="zigzag")
            finally:
                cp._chunk_attention = real_chunk
            results.put(("error", "slow_rank", rank, (len(taken), torch.equal(slow, balanced))))
            for name, q, k, v, kwargs in error_cases(rank):
                try:
                    cp.ring_attention(q, k, v, **kwargs)
                    results.put(("error", name, rank, "no error"))
                except Exception as e:  # every rank reports what it raised
                    results.put(("error", name, rank, f"{type(e).__name__}: {e}"))
            x3 = torch.randn(1, 3, 8, 16)  # 3 query heads over 2 ranks
            try:
                cp.ulysses_attention(x3, x3, x3)
                results.put(("error", "ulysses_heads", rank, "no error"))
            except Exception as e:  # noqa: BLE001
                results.put(("error", "ulysses_heads", rank, f"{type(e).__name__}: {e}"))
            # /dev/shm without room on rank 1 (its posix_fallocate fails): every rank goes over gloo, to the same bits
            xr = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(rank))
            real_fallocate = cp.os.posix_fallocate
            if rank == 1:
                cp.os.posix_fallocate = lambda fd, offset, length: (_ for _ in ()).throw(OSError(28, "no space"))
            g1 = torch.distributed.new_group([0, 1])
            try:
                no_room = cp.ring_attention(xr, xr, xr, group=g1, is_causal=True)
            finally:
                cp.os.posix_fallocate = real_fallocate
            grown = cp._HostBlocks._of_group[g1].nbytes
            roomy = cp.ring_attention(xr, xr, xr, group=torch.distributed.new_group([0, 1]), is_causal=True)
            close = torch.allclose(no_room, roomy, rtol=0, atol=2e-6)
            results.put(("error", "no_room", rank, f"equal {close}, buffer {grown} bytes"))
            # Rank 1 does not see rank 0's file (one hostname, two /dev/shm: containers on the host's network)
            real_isfile = cp.os.path.isfile
            if rank == 1:
                cp.os.path.isfile = lambda path: "cs149gpt-ring-" not in path and real_isfile(path)
            g2 = torch.distributed.new_group([0, 1])
            try:
                unseen = cp.ring_attention(xr, xr, xr, group=g2, is_causal=True)
            finally:
                cp.os.path.isfile = real_isfile
            blocks = cp._HostBlocks._of_group[g2]
            close = torch.allclose(unseen, roomy, rtol=0, atol=2e-6)
            results.put(("error", "not_seen", rank,
                         f"equal {close}, buffer {blocks.nbytes} bytes, usable {blocks.usable}"))
            # Shared memory allowed on one rank only: both raise, naming it (not a hang at mismatched collectives)
            if rank == 1:
                os.environ["CS149GPT_RING_SHM"] = "0"
            try:
                cp.ring_attention(xr, xr, xr)
                results.put(("error", "shm_disagree", rank, "no error"))
            except Exception as e:  # noqa: BLE001
                results.put(("error", "shm_disagree", rank, f"{type(e).__name__}: {e}"))
            os.environ.pop("CS149GPT_RING_SHM", None)
            # Last: rank 1 stops sending its K/V (the forward's transfers over gloo, shared memory off), then stops
            # publishing it (in shared memory); rank 0's wait ends at each group's 3 s timeout
            x = torch.randn(1, 2, 8, 16)
            for name, shm in (("silent", "0"), ("silent_shm", "1")):
                os.environ["CS149GPT_RING_SHM"] = shm
                group = torch.distributed.new_group([0, 1], timeout=timedelta(seconds=3))
                if rank == 1:
                    cp._Ring.exchange = lambda self, tensors, tag: ([], [torch.zeros_like(t) for t in tensors])
                    cp._HostBlocks.publish = lambda self, tensors, what, who="": True
                try:
                    cp.ring_attention(x, x, x, group=group)
                    results.put(("error", name, rank, "no error"))
                except Exception as e:  # noqa: BLE001
                    results.put(("error", name, rank, f"{type(e).__name__}: {e}"))
            os.environ.pop("CS149GPT_RING_SHM")
        torch.distributed.destroy_process_group()
        results.put(("done", None, rank, None))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which fails the test)
        results.put(("crash", None, rank, f"{type(e).__name__}: {e}"))


def spawn(world_size, tmp_path, device="cpu", backend=None):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world_size, str(tmp_path / "store"), results, device, backend),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    collected, done = [], 0
    try:
        while done < world_size:
            try:
                item = results.get(timeout=JOIN_SECONDS)
            except queue_module.Empty:
                pytest.fail(f"the {world_size} processes did not finish within {JOIN_SECONDS} s")
            if item[0] == "crash":
                pytest.fail(f"rank {item[2]} crashed: {item[3]}")
            done += item[0] == "done"
            collected.append(item)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    cases = {name: torch.load(io.BytesIO(blob)) for kind, name, _, blob in collected if kind == "case"}
    errors = {}
    for kind, name, rank, text in collected:
        if kind == "error":
            errors.setdefault(name, {})[rank] = text
    return cases, errors


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn(2, tmp_path_factory.mktemp("ring2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return spawn(4, tmp_path_factory.mktemp("ring4"))


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    return spawn(3, tmp_path_factory.mktemp("ring3"))


# ------------------------------------------------------------------------------------------------- references
def reference64(q, k, v, dout, causal):
    """out, lse and the gradients in float64 from the definition; causal in global positions."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ ke.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    n_q, n_k = q.shape[2], k.shape[2]
    if causal:
        shift = n_k - n_q if causal == "bottom_right" else 0
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        s = s.masked_fill(j > i + shift, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.where(lse[..., None] == -math.inf, 0.0, torch.exp(s - lse[..., None]))
    out = p @ ve
    out.backward(dout.double())
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def single_process(q, k, v, dout, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = cs149gpt.attention(q, k, v, is_causal=causal, return_lse=True)
    out.backward(dout)
    return dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)


def max_diff(a, b):
    a, b = a.double(), b.double()
    both_inf = (a == b) & torch.isinf(a)  # rows that see no key: lse −inf in both
    return (a - b).masked_fill(both_inf, 0).abs().max().item()


def check(c, got, device="cpu"):
    q, k, v, dout = inputs(c)
    one = single_process(*(t.to(device) for t in (q, k, v, dout)), c["causal"])
    one = {name: t.cpu() for name, t in one.items()}
    if c["poison"]:
        # The library's rule, as one process applies it: the same NaN/0 rows, the rows between untouched
        for name in ("out", "lse"):
            torch.testing.assert_close(got[name], one[name], equal_nan=True, atol=2e-6, rtol=0)
        assert got["out"][:, :, 1:-1].isfinite().all() and got["out"][:, :, -1].isnan().all()
        return
    ref = reference64(q, k, v, dout, c["causal"])
    bf16, fp16 = c["dtype"] == torch.bfloat16, c["dtype"] == torch.float16
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert got[name].dtype == one[name].dtype and got[name].shape == one[name].shape, name
        # Relative to the tensor's largest entry (gradients reach 10 at the longer lengths). float32: the ring's
        # merge and sums round differently from one kernel call, by a few float32 ulps; bfloat16: a few bf16 ulps
        # (each block's partial result is rounded to bf16 once); float16 the same in its ulps (8x finer)
        size = max(1.0, ref[name][ref[name].isfinite()].abs().max().item())
        to_one = (2e-2 if bf16 else 3e-3 if fp16 else 2e-6) * size
        to_ref = (3e-2 if bf16 else 5e-3 if fp16 else 2e-5) * size
        assert max_diff(got[name], one[name]) <= to_one, (name, max_diff(got[name], one[name]))
        assert max_diff(got[name], ref[name]) <= to_ref, (name, max_diff(got[name], ref[name]))
        assert max_diff(one[name], ref[name]) <= to_ref, (name, "one process vs float64")
    if "same_bits" in got:
        assert got["same_bits"].item(), "two runs of the same call differ"
    for name in ("out", "lse", "dq", "dk", "dv"):
        if f"gloo {name}" in got:  # the ring over gloo's transfers against the work-shared forward (shared memory)
            size = max(1.0, ref[name][ref[name].isfinite()].abs().max().item())
            assert max_diff(got[f"gloo {name}"], got[name]) <= (2e-2 if bf16 else 3e-3 if fp16 else 2e-6) * size, name
    if "shared_memory" in got:
        assert got["shared_memory"].item(), "the CPU ranks of one host did not use shared memory"


# ------------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("c", CASES[2], ids=[c["name"] for c in CASES[2]])
def test_ring_two_ranks(world2, c):
    cases, _ = world2
    check(c, cases[c["name"]])


@pytest.mark.parametrize("c", CASES[4], ids=[c["name"] for c in CASES[4]])
def test_ring_four_ranks(world4, c):
    cases, _ = world4
    check(c, cases[c["name"]])


@pytest.mark.parametrize("c", [c for c in CASES[2] + CASES[4] if c["h"] % 2 == 0],
                         ids=[f"{w}-{c['name']}" for w in (2, 4) for c in CASES[w] if c["h"] % 2 == 0])
def test_ulysses(world2, world4, c):
    """The all-to-all route: the same results as one process, forward and backward, in every layout and mode."""
    w = 2 if c in CASES[2] else 4
    cases, _ = world2 if w == 2 else world4
    check(c, cases[c["name"] + "/ulysses"])


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_nccl(world_size, backend, tmp_path):
    """One process a GPU over NCCL (NVLink multicast off): out, lse and gradients as one GPU's call and float64;
    with a CPU backend beside NCCL the ranks agree on the host. At 2 ranks, ranks that disagree (a mask, a length,
    a rank's tensors on the CPU) raise on both, as on the CPU."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cases, errors = spawn(world_size, tmp_path, "cuda", backend)
    for c in CUDA_CASES[world_size]:
        check(c, cases[c["name"]], "cuda")
        check(c, cases[c["name"] + "/ulysses"], "cuda")
        if world_size == 4:
            check(c, cases[c["name"] + "/usp"], "cuda")
    if world_size == 2:
        assert errors["host_agreement"] == {0: backend != "nccl", 1: backend != "nccl"}
        for name in ("disagree_causal", "disagree_length", "disagree_device"):
            assert sorted(errors[name]) == [0, 1], errors[name]
            assert all(text.startswith("ValueError: ring_attention: the ranks disagree on ")
                       for text in errors[name].values()), errors[name]
        assert "device (q.device): rank 0: cuda, rank 1: cpu" in errors["disagree_device"][0]


@pytest.mark.parametrize("c", CASES[4], ids=[c["name"] for c in CASES[4]])
def test_usp(world4, c):
    """Ulysses within ring (usp_attention, 2 x 2 ranks): one process's results, forward and backward; the 2-D
    DeviceMesh route gives the same bits as the two groups."""
    cases, _ = world4
    check(c, cases[c["name"] + "/usp"])


def test_usp_error_on_every_rank(world4):
    """One rank's bad input raises on all four, its Ulysses partner naming it, the other group's ranks naming their
    ring partner (global ranks); groups that do not form a mesh raise on all four; no hang."""
    _, errors = world4
    got = errors["usp_bad_heads"]
    assert sorted(got) == [0, 1, 2, 3], got
    assert got[3].startswith("ValueError: usp_attention: q's 3 heads do not divide"), got[3]
    for r, named in ((2, 3), (0, 2), (1, 3)):  # Ulysses group {2, 3}; ring groups {0, 2} and {1, 3}
        assert got[r].startswith(f"ValueError: usp_attention: rank(s) [{named}] of the group rejected"), got[r]
    got = errors["usp_not_a_mesh"]
    assert sorted(got) == [0, 1, 2, 3], got
    for r in range(4):
        assert got[r].startswith("ValueError: usp_attention: the ranks disagree on rank in the Ulysses group "
                                 "(ulysses_group)"), got[r]


@pytest.mark.slow
@pytest.mark.parametrize("c", CASES[3], ids=[c["name"] for c in CASES[3]])
def test_ring_three_ranks_longer(world3, c):
    """An odd world size, longer sequences, uneven local lengths."""
    cases, _ = world3
    check(c, cases[c["name"]])


@pytest.mark.parametrize("name, expect", [
    ("disagree_causal", ["ValueError: ring_attention: the ranks disagree on is_causal: rank 0: 'none', "
                         "rank 1: 'top_left'"] * 2),
    ("disagree_length", ["ValueError: ring_attention: the ranks disagree on local key length (k.shape[2]): "
                         "rank 0: 8, rank 1: 6"] * 2),
    ("bad_local_rank", ["ValueError: ring_attention: rank(s) [1]", "ValueError: ring_attention: q must be 4-D"]),
    ("bad_local_heads", ["ValueError: ring_attention: rank(s) [1]", "ValueError: ring_attention: k's heads (3)"]),
    ("ulysses_heads", ["ValueError: ulysses_attention: q's 3 heads do not divide over the group's 2 ranks"] * 2),
])
def test_ring_errors_on_every_rank(world2, name, expect):
    """Ranks that disagree, or one rank's bad input: an error on every rank, naming the argument; no hang."""
    _, errors = world2
    assert sorted(errors[name]) == [0, 1]
    for rank, prefix in enumerate(expect):
        assert errors[name][rank].startswith(prefix), errors[name][rank]


def test_ring_forward_runs_our_kernel_and_merge(world2):
    """A causal zigzag forward on 2 ranks (1 x 2 heads x 16 tokens a rank, in shared memory: the work-shared forward),
    counted by torch.profiler: the flash kernel once for each query chunk and block that it sees (chunk 0: its own
    diagonal; chunks 1, 2 and 3: a call on each rank's block, the one holding the chunk's diagonal a bottom-right
    call), 7 calls and 3 merges (merge_partial_, no elementwise torch merge) a head, for 2 heads; the items split
    between the ranks as they take them."""
    _, errors = world2
    flash, merge, addcmul = (sum(errors["ops"][r][i] for r in (0, 1)) for i in range(3))
    assert (flash, merge, addcmul) == (14, 6, 0), errors["ops"]


def test_ring_forward_shares_the_work_with_a_slow_rank(world2):
    """On one host the forward's items go to whichever rank is free: with rank 1 slowed (0.2 s an item) rank 0 takes
    most of the 16 (4 query chunks x 4 heads), and the result keeps its bits."""
    _, errors = world2
    (fast, fast_same), (slow, slow_same) = errors["slow_rank"][0], errors["slow_rank"][1]
    assert fast + slow == 16 and fast >= 12 and fast_same and slow_same, errors["slow_rank"]


def test_ring_without_room_in_dev_shm_goes_over_gloo(world2):
    """/dev/shm too full for one rank's block: no rank makes a buffer (a write past a full tmpfs is a SIGBUS),
    every rank takes gloo's transfers, and the result is the shared-memory run's (to float32 rounding)."""
    _, errors = world2
    assert errors["no_room"] == {0: "equal True, buffer 0 bytes", 1: "equal True, buffer 0 bytes"}, errors["no_room"]
    # a rank that does not see its peers' files: no rank uses shared memory on that group again
    expected = "equal True, buffer 0 bytes, usable False"
    assert errors["not_seen"] == {0: expected, 1: expected}, errors["not_seen"]


def test_ring_ranks_disagreeing_on_shared_memory_raise(world2):
    _, errors = world2
    for rank in (0, 1):
        assert errors["shm_disagree"][rank].startswith("ValueError: ring_attention: the ranks disagree on "
                                                       "CS149GPT_RING_SHM"), errors["shm_disagree"][rank]


def test_ring_timeout_names_the_step(world2):
    """A rank that stops sending: its neighbour's wait ends at the group's timeout with the step named, not a hang;
    in shared memory (one host), a rank that stops publishing its block: the same, naming the publication."""
    _, errors = world2
    assert errors["silent"][1] == "no error"
    assert errors["silent"][0].startswith("RuntimeError: ring_attention: the forward's K/V transfer at step 1 of 2 "
                                          "(rank 0 sends to rank 1, receives from rank 1) failed"), errors["silent"][0]
    assert errors["silent_shm"][0].startswith("RuntimeError: ring_attention: the forward's publication of Q, K and V "
                                              "in shared memory (rank 0 of 2) failed"), errors["silent_shm"][0]


# ------------------------------------------------------------------------------------------------- one process
@pytest.fixture
def world1(tmp_path):
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1),
                                         rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield
    torch.distributed.destroy_process_group()


def test_one_rank_is_one_kernel_call(world1):
    """W = 1: the ring (and Ulysses, and USP on a 1 x 1 mesh) is the kernel, bit for bit, forward and backward; a
    DeviceMesh stands for the group; autocast casts as torch SDPA does; torch.compile runs it (a graph break); USP
    without its groups, or with a 2-D mesh as one of them, is refused naming the argument."""
    from torch.distributed.device_mesh import init_device_mesh

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 16, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 16, 16, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(1, 4, 16, 16, generator=g)
    results = []
    for fn in (lambda: cs149gpt.attention(q, k, v, is_causal=True),
               lambda: cp.ring_attention(q, k, v, is_causal=True, layout="zigzag"),
               lambda: cp.ring_attention(q, k, v, group=init_device_mesh("cpu", (1,)), is_causal=True),
               lambda: cp.ulysses_attention(q, k, v, is_causal=True, layout="zigzag"),
               lambda: cp.usp_attention(q, k, v, mesh=init_device_mesh("cpu", (1, 1)), is_causal=True,
                                        layout="zigzag")):
        q.grad = k.grad = v.grad = None
        out = fn()
        out.backward(dout)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cp.ring_attention(q, k, v).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="usp_attention: pass mesh"):
        cp.usp_attention(q, k, v, ring_group=torch.distributed.group.WORLD)
    with pytest.raises(ValueError, match="usp_attention: ring_group is a 2-D DeviceMesh: pass it as mesh="):
        cp.usp_attention(q, k, v, ring_group=init_device_mesh("cpu", (1, 1)),
                         ulysses_group=torch.distributed.group.WORLD)
    compiled = torch.compile(lambda q, k, v: cp.ring_attention(q, k, v, is_causal=True) * 2)
    assert torch.equal(compiled(q, k, v), results[0][0] * 2)


@pytest.mark.parametrize("args, kwargs, error, match", [
    (((1, 4, 16), (1, 2, 16, 16)), {}, ValueError, "q must be 4-D"),
    (((1, 4, 16, 16), (1, 3, 16, 16)), {}, ValueError, r"k's heads \(3\) must divide q's \(4\)"),
    (((1, 4, 16, 16), (1, 2, 16, 8)), {}, ValueError, "k's head dim 8 differs from q's 16"),
    (((1, 4, 15, 16), (1, 2, 15, 16)), dict(layout="zigzag"), ValueError, "needs even local lengths"),
    (((1, 4, 16, 16), (1, 2, 16, 16)), dict(is_causal="lower"), ValueError, "is_causal must be"),
    (((1, 4, 16, 16), (1, 2, 16, 16)), dict(layout="striped"), ValueError, "layout must be one of"),
    (((1, 4, 16, 16), (1, 2, 16, 16)), dict(scale=float("nan")), ValueError, "scale must be a finite float"),
])
def test_bad_local_input(world1, args, kwargs, error, match):
    q, k = torch.randn(*args[0]), torch.randn(*args[1])
    with pytest.raises(error, match=match):
        cp.ring_attention(q, k, k, **kwargs)
    with pytest.raises(TypeError, match="share one dtype"):
        cp.ring_attention(torch.randn(1, 4, 16, 16), torch.randn(1, 2, 16, 16).double(), torch.randn(1, 2, 16, 16))


# ------------------------------------------------------------------------------------------------- no processes
def visible_by_plan(world_size, layout, nq, nk, causal):
    """The (N_q, N_k) global mask the ring's kernel calls cover, each pair counted; and each rank's work."""
    mode = cp._causal_mode(causal)
    seen = torch.zeros(world_size * nq, world_size * nk, dtype=torch.int64)
    work = []
    for rank in range(world_size):
        offset = {"none": None, "top_left": 0, "bottom_right": world_size * (nk - nq)}[mode]
        q_glob = torch.cat([torch.arange(g, g + n) for _, g, n in cp._chunks(layout, world_size, rank, nq)])
        done = 0
        for src in range(world_size):
            k_glob = torch.cat([torch.arange(g, g + n) for _, g, n in cp._chunks(layout, world_size, src, nk)])
            for q_lo, q_hi, k_lo, k_hi, kind in cp._block_calls(cp._chunks(layout, world_size, rank, nq),
                                                                 cp._chunks(layout, world_size, src, nk), offset):
                rows, cols = q_hi - q_lo, k_hi - k_lo
                i, j = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
                local = j <= i + cols - rows if kind == "bottom_right" else torch.ones(rows, cols, dtype=torch.bool)
                assert local.any(1).all(), "a call's row sees no key"
                ii, jj = local.nonzero(as_tuple=True)
                seen[q_glob[q_lo + ii], k_glob[k_lo + jj]] += 1
                done += int(local.sum())
        work.append(done)
    return seen, work


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_plan_covers_the_global_mask_once(world_size, layout, causal):
    """The kernel calls of every rank and step cover each visible (query, key) pair of the whole sequence exactly
    once and no hidden one; zigzag gives every rank the same work under the causal mask."""
    for nq, nk in ((4, 4), (6, 6), (4, 8), (8, 4), (2, 6), (10, 4)):
        seen, work = visible_by_plan(world_size, layout, nq, nk, causal)
        i, j = torch.arange(world_size * nq)[:, None], torch.arange(world_size * nk)[None, :]
        shift = {False: None, True: 0, "bottom_right": world_size * (nk - nq)}[causal]
        want = torch.ones_like(seen, dtype=torch.bool) if shift is None else j <= i + shift
        assert torch.equal(seen, want.long()), (nq, nk)
        if causal and layout == "zigzag" and nq == nk:
            assert len(set(work)) == 1, work


def test_shard_unshard_and_positions():
    x = torch.arange(2 * 16).view(2, 16)
    for layout in cp.LAYOUTS:
        shards = [cp.shard_sequence(x, 1, world_size=4, rank=r, layout=layout) for r in range(4)]
        assert torch.equal(cp.unshard_sequence(shards, 1, layout=layout), x)
        for r in range(4):
            pos = cp.shard_positions(16, world_size=4, rank=r, layout=layout)
            assert torch.equal(shards[r][0], pos) and pos.dtype == torch.int64
    assert cp.shard_positions(16, world_size=4, rank=1, layout="zigzag").tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="8 equal chunks"):
        cp.shard_sequence(torch.zeros(12), 0, world_size=4, rank=0, layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.shard_sequence(x, 1, world_size=2, rank=0, layout="striped")


@pytest.mark.parametrize("spans", [[(0, 8)], [(2, 5), (4, 9), (0, 3)], [(3, 6), (3, 6), (7, 10)], []])
def test_accumulators_start_uninitialised(spans):
    """An accumulator filled as the ring fills its own (torch.empty, each partial copied where it is the first on
    all its rows, added otherwise; the rows no partial reaches set at the end) holds what zeros + adding every
    partial holds, whatever the empty memory held (NaN here)."""
    n, g = 10, torch.Generator().manual_seed(0)
    acc, want = torch.full((1, 2, n, 3), math.nan), torch.zeros(1, 2, n, 3)
    reached = cp._Reached(n)
    for lo, hi in spans:
        part = torch.randn(1, 2, hi - lo, 3, generator=g)
        want[:, :, lo:hi] += part
        if reached.first(lo, hi, acc, 0.0):
            acc[:, :, lo:hi].copy_(part)
        else:
            acc[:, :, lo:hi].add_(part)
    reached.finish(acc, 0.0)
    assert torch.equal(acc, want)


class _Group:
    """A process group as _host_collectives sees it: a backend for CPU tensors or not."""

    def __init__(self, cpu):
        self.cpu = cpu

    def _get_backend(self, device):
        if device.type == "cpu" and self.cpu:
            return object()
        raise RuntimeError(f"No backend type associated with device type {device.type}")


@pytest.mark.parametrize("group, on_host", [(_Group(True), True), (_Group(False), False)])
def test_agreement_on_the_host_where_the_group_has_a_cpu_backend(group, on_host):
    """The ranks' agreement of CUDA tensors goes over the group's CPU backend where it has one (the host never waits
    for the GPU); an NCCL-only group agrees on the GPU. A real gloo group has one."""
    assert cp._host_collectives(group) is on_host


def test_a_gloo_group_agrees_on_the_host(tmp_path):
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(str(tmp_path / "s"), 1), rank=0,
                                         world_size=1)
    try:
        assert cp._host_collectives(None) and cp._host_collectives(torch.distributed.new_group([0]))
    finally:
        torch.distributed.destroy_process_group()
