"""The ring subcommand of bench.py: cs149gpt.distributed.ring_attention (and, --algorithm ulysses, its all-to-all
twin ulysses_attention; usp, the two combined on W/2 ring groups of 2 Ulysses ranks) over W processes of one host.

CPU (gloo): W processes, each pinned to its own usable CPUs with threads // W threads, on one sequence of N tokens,
against one process with all threads on the whole sequence (strong scaling at equal total cores: peer/ours >= 0.8
is the target). CUDA (NCCL, one process a GPU; NVLink multicast off): W GPUs on N tokens against one GPU on N / W
tokens (weak scaling at the same per-GPU length: a GPU of the ring does W times that work under any mask, so the
peer's time is W × the one GPU's, and peer/ours is the efficiency, target >= 0.85), and against torch's
context_parallel with its SDPA on the same GPUs and sequence (skipped where it cannot run).

Every rank builds only its own tokens (the whole sequence is 2·lcm(W) chunks, each from its own seed), so a rank's
peak memory is that of its N / W tokens; the largest rank's peak (torch's allocator, one forward + backward) is in the note.
The ring's output is checked against one process on the whole sequence (CUDA: up to --check-max tokens).
Times: the median over --rounds rounds after one probe call, a round --calls calls back to back (CUDA 4: a model's
layers call it so, the host queueing a call while the GPU runs the one before) started by a barrier; the slowest
rank's. The process group on CUDA: 'cpu:gloo,cuda:nccl' (--dist-backend), whose CPU side carries the ranks' agreement.
"""
from __future__ import annotations

import argparse
import io
import math
import multiprocessing
import os
import queue as queue_module
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Tuple

import torch
import torch.nn.functional as F

from _timing import DTYPES, MATCH_TOLERANCE, Row, first_line, max_err, peak_allocator_mib, usable_cpus

import cs149gpt
from cs149gpt import distributed as cp

WAIT_SECONDS = 1800


# ------------------------------------------------------------------------------------------------- inputs
def token_chunk(kind: int, index: int, shape, dtype, device) -> torch.Tensor:
    """Chunk `index` of q (kind 0), k (1), v (2) or dout (3): (B, H, chunk, d), the same in every process."""
    g = torch.Generator().manual_seed(1000 * kind + index)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def tokens(kind: int, spec: dict, ranges, device) -> torch.Tensor:
    """The tokens [start, start + length) of each range, concatenated, of the whole sequence described by spec."""
    b, h, n, d, chunks = spec["b"], spec["h"], spec["n"], spec["d"], spec["chunks"]
    size = n // chunks
    parts = []
    for start, length in ranges:
        for c in range(start // size, (start + length) // size):
            parts.append(token_chunk(kind, c, (b, h, size, d), DTYPES[spec["dtype"]], device))
    return torch.cat(parts, 2)


def local_ranges(spec: dict, world_size: int, rank: int):
    return [(g, n) for _, g, n in cp._chunks(spec["layout"], world_size, rank, spec["n"] // world_size)]


def usp_shape(world_size: int) -> Tuple[int, int]:
    """--algorithm usp's mesh (R ring groups' ranks, U a Ulysses group's): U = 2 where W is even, so 4 ranks are 2 x 2
    (and 2 ranks one Ulysses group)."""
    u = 2 if world_size % 2 == 0 else 1
    return world_size // u, u


def usp_ranges(spec: dict, world_size: int, rank: int):
    """Rank (r, u)'s tokens (rank = r·U + u): part u, contiguous, of ring share r (usp_attention's docstring)."""
    r_size, u_size = usp_shape(world_size)
    r, u = divmod(rank, u_size)
    share = local_ranges(spec, r_size, r)
    part = spec["n"] // world_size
    lo, hi, at, ranges = u * part, (u + 1) * part, 0, []
    for start, length in share:  # the share's runs, cut to [lo, hi) of their concatenation
        a, b = max(lo, at), min(hi, at + length)
        if a < b:
            ranges.append((start + a - at, b - a))
        at += length
    return ranges


def usp_unshard(outs, spec: dict, world_size: int) -> torch.Tensor:
    r_size, u_size = usp_shape(world_size)
    shares = [torch.cat(outs[r * u_size:(r + 1) * u_size], 2) for r in range(r_size)]
    return cp.unshard_sequence(shares, 2, layout=spec["layout"])


def flops(spec: dict, n: int) -> float:
    """The two forward products over the visible pairs, 4·B·H·pairs·d (as bench_cpu counts them)."""
    pairs = n * (n + 1) // 2 if spec["causal"] else n * n
    return 4.0 * spec["b"] * spec["h"] * pairs * spec["d"]


# ------------------------------------------------------------------------------------------------- timing
def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, rounds: int, device, barrier=None, calls: int = 1) -> float:
    """Seconds a call: the median over rounds of `calls` calls back to back (as a model's layers make them: the host
    queues a call while the GPU runs the one before), each round started by a barrier."""
    fn()  # the probe: warms up
    times = []
    for _ in range(rounds):
        sync(device)
        if barrier:
            barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def phases(call, inputs, dout):
    """{"fwd": forward alone (no autograd), "fwd+bwd": forward and backward}."""
    def forward():
        with torch.no_grad():
            return call(*inputs)

    def forward_backward():
        for t in inputs:
            t.grad = None
        call(*inputs).backward(dout)

    return {"fwd": forward, "fwd+bwd": forward_backward}


def peak_mib(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return peak_allocator_mib(fn) or float("nan")


# ------------------------------------------------------------------------------------------------- the ranks
def rank_main(rank: int, world_size: int, spec: dict, store_path: str, results) -> None:
    try:
        results.put((rank, rank_run(rank, world_size, spec, store_path)))
    except BaseException as e:  # noqa: BLE001 (the parent reports it)
        results.put((rank, f"{type(e).__name__}: {first_line(e)}"))


def rank_run(rank: int, world_size: int, spec: dict, store_path: str) -> dict:
    cuda = spec["device"] == "cuda"
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        per = max(1, spec["threads"] // world_size)
        if spec["threads"] >= world_size and len(cpus) >= spec["threads"] and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus[rank * per:(rank + 1) * per])
        torch.set_num_threads(per)
    store = torch.distributed.FileStore(store_path, world_size)
    torch.distributed.init_process_group(spec["backend"], store=store, rank=rank, world_size=world_size,
                                         timeout=timedelta(seconds=600), device_id=device if cuda else None)
    barrier = torch.distributed.barrier
    report = {}
    if "usp" in spec["algorithms"]:  # its groups (every rank makes every group, in one order)
        r_size, u_size = usp_shape(world_size)
        rings = [torch.distributed.new_group(list(range(u, world_size, u_size))) for u in range(u_size)]
        ulysses = [torch.distributed.new_group(list(range(r * u_size, (r + 1) * u_size))) for r in range(r_size)]
        groups = dict(ring_group=rings[rank % u_size], ulysses_group=ulysses[rank // u_size])
    for algorithm in spec["algorithms"]:
        ranges = (usp_ranges if algorithm == "usp" else local_ranges)(spec, world_size, rank)
        q, k, v, dout = (tokens(kind, spec, ranges, device) for kind in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        attend = getattr(cp, f"{algorithm}_attention")
        route = groups if algorithm == "usp" else {}
        call = lambda q, k, v: attend(q, k, v, is_causal=spec["causal"], layout=spec["layout"], **route)  # noqa: E731
        for phase, fn in phases(call, (q, k, v), dout).items():
            report[f"{algorithm} {phase}"] = median_seconds(fn, spec["rounds"], device, barrier, spec["calls"])
        report[f"{algorithm} peak_mib"] = peak_mib(phases(call, (q, k, v), dout)["fwd+bwd"], device)
        with torch.no_grad():
            out = call(q, k, v)
        buffer = io.BytesIO()
        torch.save(out.cpu(), buffer)
        report[f"{algorithm} out"] = buffer.getvalue()
    if cuda and spec["torch_cp"]:
        report.update(torch_context_parallel(spec, world_size, device, barrier))
    if not cuda:  # the forward's route: shared memory (a buffer was made) or gloo's transfers
        blocks = cp._HostBlocks._of_group.get(torch.distributed.group.WORLD)
        shared = blocks is not None and blocks.nbytes > 0
        report["route"] = "forward through shared memory" if shared else "forward over gloo"
    torch.distributed.destroy_process_group()
    return report


def torch_context_parallel(spec: dict, world_size: int, device, barrier) -> dict:
    """torch.distributed.tensor.experimental.context_parallel with SDPA on the same sequence: its times, or why not."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cuda", (world_size,))
        whole = [(0, spec["n"])]
        q, k, v, dout = (tokens(kind, spec, whole, device) for kind in range(4))
        # It shards its buffers in place (head-tail when causal) and puts SDPA on DTensor's ring while inside.
        with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2],
                              no_restore_buffers={q, k, v, dout}):
            for t in (q, k, v):
                t.requires_grad_()
            call = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=spec["causal"])  # noqa: E731
            return {f"torch_cp {phase}": median_seconds(fn, spec["rounds"], device, barrier, spec["calls"])
                    for phase, fn in phases(call, (q, k, v), dout).items()}
    except Exception as e:  # noqa: BLE001 (an experimental API: say why it did not run)
        return {"torch_cp error": f"{type(e).__name__}: {first_line(e)}"}


def run_ranks(world_size: int, spec: dict) -> dict:
    """Spawns the W ranks; returns rank 0's report with the slowest rank's times and every rank's output."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, world_size, spec, os.path.join(tmp, "store"), results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        reports = {}
        try:
            while len(reports) < world_size:
                rank, report = results.get(timeout=WAIT_SECONDS)
                if isinstance(report, str):
                    raise RuntimeError(f"rank {rank}: {report}")
                reports[rank] = report
        except queue_module.Empty:
            raise RuntimeError(f"the {world_size} ranks did not finish within {WAIT_SECONDS} s") from None
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    merged = dict(reports[0])
    for key, value in reports[0].items():
        if isinstance(value, float):  # times and peak memory: the slowest, the largest rank
            merged[key] = max(r[key] for r in reports.values())
    for algorithm in spec["algorithms"]:
        merged[f"{algorithm} outs"] = [torch.load(io.BytesIO(reports[r][f"{algorithm} out"])) for r in range(world_size)]
    return merged


# ------------------------------------------------------------------------------------------------- rows
def one_device(spec: dict, n: int, device, threads: int):
    """The one-process peer on n tokens: {phase: seconds}, peak MiB of fwd+bwd, and its output."""
    torch.set_num_threads(threads)
    sub = dict(spec, n=n)
    whole = [(0, n)]
    q, k, v, dout = (tokens(kind, sub, whole, device) for kind in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    call = lambda q, k, v: cs149gpt.attention(q, k, v, is_causal=spec["causal"])  # noqa: E731
    fns = phases(call, (q, k, v), dout)
    times = {phase: median_seconds(fn, spec["rounds"], device, calls=spec["calls"]) for phase, fn in fns.items()}
    mib = peak_mib(fns["fwd+bwd"], device)
    with torch.no_grad():
        out = call(q, k, v).cpu()
    return times, mib, out


def ring_rows(spec: dict, world_size: int, args) -> list[Row]:
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    n, threads = spec["n"], spec["threads"]
    mode = "causal " if spec["causal"] else ""
    print(f"  ring W={world_size} N={n} {spec['dtype']} ...", file=sys.stderr, flush=True)
    if cuda:
        peer_times, peer_mib, _ = one_device(spec, n // world_size, device, threads)
        reference = one_device(spec, n, device, threads)[2] if n <= args.check_max else None
        torch.cuda.empty_cache()
    else:
        peer_times, peer_mib, reference = one_device(spec, n, device, threads)
    ranks = run_ranks(world_size, spec)
    rows = []
    for algorithm in spec["algorithms"]:
        rows += algorithm_rows(spec, world_size, args, algorithm, ranks, peer_times, peer_mib, reference)
    return rows


def algorithm_rows(spec, world_size, args, algorithm, ranks, peer_times, peer_mib, reference) -> list[Row]:
    cuda = spec["device"] == "cuda"
    n, threads = spec["n"], spec["threads"]
    mode = "causal " if spec["causal"] else ""
    ring = {key[len(algorithm) + 1:]: value for key, value in ranks.items() if key.startswith(algorithm + " ")}
    ring.update({key: value for key, value in ranks.items() if key.startswith("torch_cp")})
    err = None
    if reference is not None:
        whole = (usp_unshard(ring["outs"], spec, world_size) if algorithm == "usp"
                 else cp.unshard_sequence(ring["outs"], 2, layout=spec["layout"]))
        err = max_err(whole, reference)
    rows = []
    ours = f"{algorithm} {world_size} GPUs" if cuda else f"{algorithm} {world_size} × {max(1, threads // world_size)} threads"
    for phase, work_factor in (("fwd", 1.0), ("fwd+bwd", 3.5)):
        case = (f"{phase} W={world_size} ({spec['b']},{spec['h']},{n},{spec['d']}) {mode}{spec['layout']}")
        work = flops(spec, n) * work_factor / (1e12 * world_size if cuda else 1e9)
        if cuda:
            peer, peer_ms = f"1 GPU at N/{world_size} (×{world_size} work)", world_size * peer_times[phase] * 1e3
        else:
            peer, peer_ms = f"1 process × {threads} threads", peer_times[phase] * 1e3
        ours_ms = ring[phase] * 1e3
        row = Row("ring", case, spec["dtype"], None if cuda else threads, ours, peer,
                  ours_ms=ours_ms, peer_ms=peer_ms, ratio=peer_ms / ours_ms, rate=work / ring[phase],
                  unit="TFLOP/s a GPU" if cuda else "GFLOP/s", err=err)
        if err is None:
            row.add_note(f"not checked (N > --check-max {args.check_max})")
        elif not err <= MATCH_TOLERANCE[DTYPES[spec["dtype"]]]:
            row.status = "wrong"
            row.add_note(f"WRONG: error {err:.3g}")
        if phase == "fwd+bwd":
            row.add_note(f"peak MiB a rank {ring['peak_mib']:.0f}, one {'GPU' if cuda else 'process'} "
                         f"{peer_mib:.0f}")
        if "route" in ranks:
            row.add_note(ranks["route"])
        rows.append(row)
        if cuda and spec["torch_cp"]:
            theirs = ring.get(f"torch_cp {phase}")
            row = Row("ring", case, spec["dtype"], None, ours, "torch context_parallel + SDPA",
                      ours_ms=ours_ms, err=err)
            if theirs is None:
                row.status, row.note = "skipped", ring.get("torch_cp error", "did not run")
            else:
                row.peer_ms, row.ratio = theirs * 1e3, theirs / ring[phase]
            rows.append(row)
    return rows


def run_ring(args) -> list[Row]:
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        return [Row("ring", "—", "—", None, "ring", "—", status="skipped", note="no CUDA GPU")]
    worlds = args.world or ([2] if args.quick else [2, 4])
    if cuda and max(worlds) > torch.cuda.device_count():
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    threads = args.threads[0]
    b, h, d = 1, args.heads or (2 if args.quick else 8), args.head_dim or (64 if args.quick else 128)
    n = args.seq or (1024 if args.quick else 32768)
    chunks = 2 * math.lcm(*worlds)
    if n % chunks:
        raise SystemExit(f"--seq {n} must divide into {chunks} chunks (2 × the least common multiple of --world)")
    rows = []
    for dtype in args.dtype or (["bfloat16"] if cuda else ["float32", "bfloat16"]):
        for world_size in worlds:
            if not cuda and threads % world_size:
                print(f"warning: {threads} threads do not split evenly over {world_size} processes", file=sys.stderr)
            spec = dict(device=args.device, dtype=dtype, b=b, h=h, n=n, d=d, chunks=chunks,
                        causal=(args.causal or "on") == "on", layout=args.layout, threads=threads,
                        rounds=args.rounds, torch_cp=cuda and not args.no_torch_cp, algorithms=args.algorithm,
                        calls=args.calls or (4 if cuda else 1),
                        backend=args.dist_backend or ("cpu:gloo,cuda:nccl" if cuda else "gloo"))
            try:
                rows += ring_rows(spec, world_size, args)
            except RuntimeError as e:
                rows.append(Row("ring", f"W={world_size} N={n}", dtype, threads, f"ring {world_size}", "—",
                                status="error", note=first_line(e)))
    return rows


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def register(sub, common: argparse.ArgumentParser) -> None:
    text = ("context-parallel ring attention over W processes (gloo: vs one process with all threads; --device cuda: "
            "NCCL, weak scaling vs one GPU, and vs torch's context_parallel)")
    p = sub.add_parser("ring", parents=[common], help=text, description=text)
    p.set_defaults(run=run_ring)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world", type=parse_ints, default=None, help="comma list of process counts (default 2,4)")
    p.add_argument("--seq", type=int, default=None, help="total tokens N (default 32768; --quick 1024)")
    p.add_argument("--heads", type=int, default=None, help="H (default 8; --quick 2)")
    p.add_argument("--head-dim", type=int, default=None, help="d (default 128; --quick 64)")
    p.add_argument("--layout", choices=cp.LAYOUTS, default="zigzag")
    p.add_argument("--algorithm", type=lambda t: t.split(","), default=["ring"],
                   help="comma list of ring,ulysses,usp (default ring; usp: W/2 ring groups of 2 Ulysses ranks)")
    p.add_argument("--check-max", type=int, default=65536,
                   help="CUDA: check the ring against one GPU on the whole sequence up to this many tokens")
    p.add_argument("--no-torch-cp", action="store_true", help="CUDA: skip torch's context_parallel")
    p.add_argument("--calls", type=int, default=None,
                   help="calls back to back in a timed round (default CUDA 4, as a model's layers; CPU 1)")
    p.add_argument("--dist-backend", default=None,
                   help="init_process_group's backend (default CUDA 'cpu:gloo,cuda:nccl', whose CPU side takes the "
                        "ranks' agreement off the GPU; CPU 'gloo')")
