#!/usr/bin/env python3
"""Times cs149gpt's attention kernels against PyTorch's, in the same run, on the CPU.

For every configuration (shape, causal, dtype, thread count) it times naive, blocked, fused and flash next to
two PyTorch baselines, interleaved so that drift of the machine (clock, temperature, neighbours) hits all alike:

    sdpa    torch.nn.functional.scaled_dot_product_attention
    manual  torch.softmax(q @ k.transpose(-2, -1) * scale [+ mask], -1) @ v

and prints median time, GFLOP/s and the ratio to SDPA (SDPA time / our time: > 1 means faster than SDPA).

    python benchmarks/bench_attention.py                         # quick set, a minute or two on 2 cores
    python benchmarks/bench_attention.py --preset full --threads 1,all --causal both
    python benchmarks/bench_attention.py --shapes 1,12,1024,64 --impls flash --dtype float32,bfloat16
    python benchmarks/bench_attention.py --memory --markdown --json results.json --plot results.png

FLOPs are those of the two matrix multiplies, 4·B·H·Σ(visible (i, j) pairs)·d: all Nq·Nk pairs without a
mask, about half with the causal one. Softmax's O(N²) exponentials are not counted, as in the FlashAttention
papers; every implementation is charged the same work, so a GFLOP/s ratio is a time ratio.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils import benchmark

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import cs149gpt  # noqa: E402  (needs the repo root on sys.path first)

BASELINES = ("sdpa", "manual")
OURS = tuple(cs149gpt.IMPLS)
# Timing order within a round; each round runs the reverse of the previous one (sdpa, ..., flash, flash, ..., sdpa),
# so no implementation always runs right after the same neighbour or always at the same point of a drift.
ALL_IMPLS = BASELINES + OURS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# Largest |ours - sdpa| still called a match. A sanity check that catches a wrong kernel, not an accuracy test
# (tests/ does that): the two differ by rounding only, which grows with the dtype's epsilon.
MATCH_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 6e-2, torch.float16: 1e-2}

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Shape:
    """q, k and v are all (batch, heads, seq_len, head_dim): self-attention, Nq = Nk = seq_len."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int

    def __str__(self) -> str:
        return f"{self.batch},{self.heads},{self.seq_len},{self.head_dim}"


@dataclasses.dataclass(frozen=True)
class Workload:
    """A shape, and, in a preset, the implementations worth its time (None: all that --impls asks for)."""

    shape: Shape
    only_impls: Optional[tuple[str, ...]] = None


PRESETS = {
    # About a minute on the 2-core dev box. At (4,12,2048,64) one call of naive, blocked or manual takes seconds
    # there, and each is timed about five times: that shape is for the O(N)-memory kernels against sdpa.
    "quick": (
        Workload(Shape(1, 4, 1024, 32)),
        Workload(Shape(1, 12, 1024, 64)),
        Workload(Shape(4, 12, 2048, 64), only_impls=("sdpa", "fused", "flash")),
    ),
    # The set. Slow implementations still drop out through --max-call-seconds and --max-score-mib.
    "full": tuple(
        Workload(Shape(*s))
        for s in ((1, 4, 1024, 32), (1, 12, 1024, 64), (4, 12, 2048, 64), (1, 16, 4096, 128), (1, 32, 8192, 64))
    ),
}


@dataclasses.dataclass(frozen=True)
class Config:
    shape: Shape
    causal: bool
    dtype: torch.dtype
    threads: int

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclasses.dataclass
class Row:
    """One implementation on one configuration; the unit of the table, the JSON and the plot."""

    shape: Shape
    causal: bool
    dtype: str
    threads: int
    impl: str
    status: str  # "ok", "mismatch" (timed, but its output disagrees with sdpa's), "skipped", "unsupported", "error"
    note: str = ""
    gflop: float = 0.0  # the work, per the FLOP count in the module docstring
    median_s: Optional[float] = None
    iqr_s: Optional[float] = None
    samples: int = 0
    gflops: Optional[float] = None
    ratio_to_sdpa: Optional[float] = None  # sdpa median time / this median time
    pct_of_peak: Optional[float] = None
    peak_extra_bytes: Optional[int] = None  # see peak_allocator_bytes() for what this can and cannot see
    max_abs_err_vs_sdpa: Optional[float] = None
    first_call_s: Optional[float] = None  # the untimed probe call: warm-up, output check, --max-call-seconds
    load_average_1min: Optional[float] = None  # when the configuration started: other work on the CPUs

    @property
    def timed(self) -> bool:
        return self.median_s is not None


# ------------------------------------------------------------------------------------------------------------
# Work, peak and machine
# ------------------------------------------------------------------------------------------------------------
def visible_pairs(q_len: int, kv_len: int, causal: bool) -> int:
    """(query, key) pairs that enter the softmax: all of them, or j <= i (SDPA's top-left causal alignment)."""
    if not causal:
        return q_len * kv_len
    full_rows = max(q_len - kv_len, 0)  # rows past the last key see every key
    ramp = min(q_len, kv_len)  # rows 0..ramp-1 see i + 1 keys
    return ramp * (ramp + 1) // 2 + full_rows * kv_len


def attention_flops(shape: Shape, causal: bool) -> int:
    # Per visible pair: a d-long dot product for q·k and a d-long multiply-add into the output, 2 FLOPs each.
    return 4 * shape.batch * shape.heads * visible_pairs(shape.seq_len, shape.seq_len, causal) * shape.head_dim


FMA_PROBE_REPEATS = 3  # of about 0.2 s each
_fma_peak_cache: dict[tuple[int, str], Optional[float]] = {}


def fma_peak_gflops(threads: int, dtype: torch.dtype) -> Optional[float]:
    """This machine's peak rate for `dtype` in GFLOP/s (a multiply-add is 2 FLOPs) on `threads` threads, or None.

    float32 and float16 (which our kernels compute in float32 FMAs): cs149gpt's FMA probe, independent chains of
    float32 vector FMAs on the ISA cs149gpt.isa() reports. bfloat16 on an ISA with bf16 dot products (amx,
    avx512_bf16): its bf16 probe (AMX tiles or vdpbf16ps), the ceiling of our bf16 path. Measured once per
    (thread count, kind); None where the compiled module has no probe, and then "% of peak" is left out.
    """
    from cs149gpt import _ext

    module = _ext.load()
    bf16_probe = getattr(module, "bf16_peak_gflops", None)
    use_bf16 = dtype == torch.bfloat16 and bf16_probe is not None and bf16_probe(1, 0.01) is not None
    key = (threads, "bf16" if use_bf16 else "fma")
    if key not in _fma_peak_cache:
        probe = bf16_probe if use_bf16 else getattr(module, "fma_peak_gflops", None)
        # Anything else running on the CPUs only lowers a measured peak, never raises it: keep the best of a few.
        _fma_peak_cache[key] = max(float(probe(threads)) for _ in range(FMA_PROBE_REPEATS)) if probe else None
    return _fma_peak_cache[key]


def read_cpuinfo() -> list[dict[str, str]]:
    """/proc/cpuinfo as one dict per logical CPU; empty where there is none (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    cpus = []
    for block in text.strip().split("\n\n"):
        fields = {}
        for line in block.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        cpus.append(fields)
    return cpus


def usable_cpus() -> int:
    # The CPUs this process may run on (taskset, a container's cpuset), which os.cpu_count() does not know about:
    # "all" threads means one per usable CPU, not one per CPU in the box.
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def available_memory_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def git_revision() -> Optional[str]:
    try:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                  text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return revision + ("-dirty" if dirty else "")


def machine_info() -> dict:
    cpus = read_cpuinfo()
    flags = set(cpus[0].get("flags", "").split()) if cpus else set()
    cores = {(c.get("physical id"), c.get("core id")) for c in cpus if "core id" in c}
    return {
        "cpu_model": cpus[0].get("model name", platform.processor()) if cpus else platform.processor(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": len(cores) or None,
        "usable_cpus": usable_cpus(),
        # What decides the ceiling of each dtype on this CPU.
        "simd_flags": sorted(flags & {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}),
        "memory_available_bytes": available_memory_bytes(),
        # Other work on the machine is the first suspect of a noisy or slow run: keep the evidence with it.
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "isa": cs149gpt.isa(),
        "env": {k: os.environ.get(k) for k in ("CS149GPT_ISA", "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES")},
        "git_revision": git_revision(),
    }


# ------------------------------------------------------------------------------------------------------------
# Running one implementation
# ------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    # torch.set_num_threads also sets the OpenMP runtime's thread count, which cs149gpt's kernels share.
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    # Kineto writes two "profiler_start/stop" lines straight to file descriptor 2 on every profile, and no
    # environment variable turns them off; they would bury the progress lines.
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_allocator_bytes(run: Callable[[], torch.Tensor], threads: int) -> Optional[int]:
    """The most bytes torch's CPU allocator held, beyond what it held before, during one call of run().

    Taken from torch.profiler's memory events (profile_memory=True): the running sum of their signed sizes in
    time order. The output tensor counts, as it is allocated during the call; so does the score matrix of naive
    and blocked and the workspace of the others, which module.cpp takes from torch's allocator. The profiler
    cannot see memory a kernel takes from malloc/new itself, allocations on threads it does not follow, or the
    scratch MKL and oneDNN keep to themselves. None if this torch has no such events to read.
    """
    from torch.profiler import ProfilerActivity, profile

    with torch_threads(threads), stderr_silenced(), profile(activities=[ProfilerActivity.CPU],
                                                            profile_memory=True) as prof:
        run()
    try:
        # The raw Kineto events: FunctionEvent folds an allocation into the op that made it, losing its time.
        events = prof.profiler.kineto_results.events()
    except AttributeError:
        return None
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events
                         if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    held = peak = 0
    for _, nbytes in allocations:
        held += nbytes
        peak = max(peak, held)
    return peak


def make_runners(config: Config, impls: Sequence[str], seed: int = 0) -> dict[str, Callable[[], torch.Tensor]]:
    s = config.shape
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s.batch, s.heads, s.seq_len, s.head_dim, generator=generator).to(config.dtype)
               for _ in range(3))
    scale = 1.0 / math.sqrt(s.head_dim)  # everyone's default; spelled out because manual needs it
    causal = config.causal

    runners: dict[str, Callable[[], torch.Tensor]] = {}
    for impl in impls:
        if impl == "sdpa":
            runners[impl] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        elif impl == "manual":
            # The additive mask is built once, outside the timing, as a model would keep it in a buffer.
            mask = (torch.full((s.seq_len, s.seq_len), float("-inf"), dtype=config.dtype).triu(1) if causal
                    else None)
            if mask is None:
                runners[impl] = lambda: torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v
            else:
                runners[impl] = lambda: torch.softmax(q @ k.transpose(-2, -1) * scale + mask, dim=-1) @ v
        else:
            runners[impl] = (lambda impl=impl:
                             cs149gpt.attention(q, k, v, impl=impl, scale=scale, is_causal=causal))
    return runners


def memory_skip_reason(impl: str, config: Config, max_score_mib: float) -> Optional[str]:
    s, n = config.shape, config.shape.seq_len
    if impl in ("naive", "blocked"):
        # One float32 N×N score matrix, reused head after head.
        score_mib = n * n * 4 / MIB
        if score_mib > max_score_mib:
            return f"its {n}×{n} score matrix is {score_mib:.0f} MiB > --max-score-mib {max_score_mib:g}"
    if impl == "manual":
        # Every head's scores at once, and two such tensors live at a time (the scores and their softmax).
        needed = 2 * s.batch * s.heads * n * n * config.dtype.itemsize
        available = available_memory_bytes()
        if available is not None and needed > available // 2:
            return (f"its scores take {needed / MIB:.0f} MiB, more than half of the "
                    f"{available / MIB:.0f} MiB available")
    return None


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# ------------------------------------------------------------------------------------------------------------
# One configuration: probe every implementation, then time the survivors interleaved
# ------------------------------------------------------------------------------------------------------------
class SpeedHistory:
    """The GFLOP/s each implementation reached so far in this run, to predict a call's length before making it.

    Rates are kept per thread count and dtype, and within those per head dim: the head dim changes a kernel's
    speed most (register blocking, bytes per row), so a prediction takes the latest rate at the same head dim,
    else the latest at any.
    """

    def __init__(self) -> None:
        self._rates: dict[tuple[str, int, torch.dtype], dict[int, float]] = {}

    def record(self, impl: str, config: Config, gflops: float) -> None:
        by_head_dim = self._rates.setdefault((impl, config.threads, config.dtype), {})
        by_head_dim.pop(config.shape.head_dim, None)  # re-insert: dict order is recency order
        by_head_dim[config.shape.head_dim] = gflops

    def predict(self, impl: str, config: Config) -> Optional[float]:
        by_head_dim = self._rates.get((impl, config.threads, config.dtype))
        if not by_head_dim:
            return None
        return by_head_dim.get(config.shape.head_dim, next(reversed(by_head_dim.values())))


def run_config(config: Config, impls: Sequence[str], args: argparse.Namespace,
               speeds: SpeedHistory, not_in_preset: Sequence[str]) -> list[Row]:
    gflop = attention_flops(config.shape, config.causal) / 1e9
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = {impl: Row(config.shape, config.causal, config.dtype_name, config.threads, impl, "ok", gflop=gflop,
                      load_average_1min=load)
            for impl in impls}
    for impl in not_in_preset:
        rows[impl] = Row(config.shape, config.causal, config.dtype_name, config.threads, impl, "skipped", gflop=gflop,
                         load_average_1min=load,
                         note=f"left out of --preset {args.preset} at this size (seconds per call)")
    runners = make_runners(config, impls)

    def skip(impl: str, status: str, note: str) -> None:
        rows[impl].status, rows[impl].note = status, note

    # Probe: one call each, which warms it up, checks its output against sdpa's, and tells whether a full
    # measurement fits in --max-call-seconds. sdpa goes first: it is the reference.
    reference = None
    for impl in impls:
        if reason := memory_skip_reason(impl, config, args.max_score_mib):
            skip(impl, "skipped", reason)
            continue
        if (predicted_gflops := speeds.predict(impl, config)) is not None:
            estimate_s = gflop / predicted_gflops
            if estimate_s > args.max_call_seconds:
                skip(impl, "skipped", f"~{estimate_s:.1f} s per call (at the {predicted_gflops:.1f} GFLOP/s "
                                      f"seen on an earlier shape) > --max-call-seconds {args.max_call_seconds:g}")
                continue
        try:
            with torch_threads(config.threads):
                start = time.perf_counter()
                out = runners[impl]()
                elapsed_s = time.perf_counter() - start
        except TypeError as e:  # how cs149gpt and torch reject a dtype they do not implement
            skip(impl, "unsupported", first_line(e))
            continue
        except (RuntimeError, ValueError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            skip(impl, "error", f"{type(e).__name__}: {first_line(e)}")
            continue
        rows[impl].first_call_s = elapsed_s
        # A first call pays for cold caches and first-touched pages, so this rate seldom flatters the kernel;
        # the timing below replaces it.
        speeds.record(impl, config, gflop / elapsed_s)
        if impl == "sdpa":
            reference = out
        elif reference is not None:
            err = (out.float() - reference.float()).abs().max().item()
            rows[impl].max_abs_err_vs_sdpa = err
            if not err <= MATCH_TOLERANCE[config.dtype]:  # `not <=` also catches NaN
                skip(impl, "mismatch", f"WRONG: max |out - sdpa| = {err:.3g} > {MATCH_TOLERANCE[config.dtype]:g}")
        if elapsed_s > args.max_call_seconds:
            skip(impl, "skipped", f"one call took {elapsed_s:.1f} s > --max-call-seconds {args.max_call_seconds:g}")
        del out
    del reference

    runnable = [impl for impl in impls if rows[impl].status in ("ok", "mismatch")]

    if args.memory:
        for impl in runnable:
            rows[impl].peak_extra_bytes = peak_allocator_bytes(runners[impl], config.threads)

    timers = {impl: benchmark.Timer(stmt="run()", globals={"run": runners[impl]}, num_threads=config.threads,
                                    label="attention", sub_label=f"{config}", description=impl)
              for impl in runnable}
    measurements: dict[str, list[benchmark.Measurement]] = {impl: [] for impl in runnable}
    for round_index in range(args.rounds):
        order = runnable if round_index % 2 == 0 else runnable[::-1]
        for impl in order:
            measurements[impl].append(timers[impl].blocked_autorange(min_run_time=args.min_run_time / args.rounds))

    for impl in runnable:
        merged = benchmark.Measurement.merge(measurements[impl])[0]
        row = rows[impl]
        row.median_s, row.iqr_s, row.samples = merged.median, merged.iqr, len(merged.times)
        row.gflops = gflop / merged.median
        speeds.record(impl, config, row.gflops)
        if (peak := fma_peak_gflops(config.threads, config.dtype)) is not None:
            row.pct_of_peak = 100.0 * row.gflops / peak
        # A wide spread means the machine was busy: the median is then a weaker number. Say so next to it.
        if row.iqr_s > args.noisy_iqr * row.median_s:
            noisy = f"noisy: IQR {100 * row.iqr_s / row.median_s:.0f}% of median"
            row.note = f"{row.note}; {noisy}" if row.note else noisy
    sdpa = rows.get("sdpa")
    if sdpa is not None and sdpa.timed:
        for row in rows.values():
            if row.timed:
                row.ratio_to_sdpa = sdpa.median_s / row.median_s
    return [rows[impl] for impl in ALL_IMPLS if impl in rows]


# ------------------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Column:
    title: str
    width: int
    cell: Callable[[Row], str]
    align_left: bool = False


def table_columns(show_peak: bool, show_memory: bool) -> list[Column]:
    def number(value: Optional[float], fmt: str) -> str:
        return "—" if value is None else format(value, fmt)

    columns = [
        Column("shape (B,H,N,d)", 16, lambda r: str(r.shape), align_left=True),
        Column("causal", 6, lambda r: "yes" if r.causal else "no", align_left=True),
        Column("dtype", 8, lambda r: r.dtype, align_left=True),
        Column("threads", 7, lambda r: str(r.threads)),
        Column("impl", 7, lambda r: r.impl, align_left=True),
        Column("ms", 9, lambda r: number(r.median_s and r.median_s * 1e3, ".2f")),
        Column("GFLOP/s", 8, lambda r: number(r.gflops, ".1f")),
        Column("×SDPA", 6, lambda r: number(r.ratio_to_sdpa, ".2f")),
    ]
    if show_peak:
        columns.append(Column("% of peak", 10, lambda r: number(r.pct_of_peak, ".1f")))
    if show_memory:
        columns.append(Column("peak MiB", 8, lambda r: number(r.peak_extra_bytes and r.peak_extra_bytes / MIB, ".1f")))
    columns.append(Column("note", 0, lambda r: r.note if r.status == "ok" else f"{r.status}: {r.note}",
                          align_left=True))
    return columns


def text_line(columns: Sequence[Column], cells: Sequence[str]) -> str:
    return "  ".join(cell.ljust(c.width) if c.align_left else cell.rjust(c.width)
                     for c, cell in zip(columns, cells)).rstrip()


def markdown_table(rows: Sequence[Row], columns: Sequence[Column]) -> str:
    lines = ["| " + " | ".join(c.title for c in columns) + " |",
             "|" + "|".join(":---" if c.align_left else "---:" for c in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(c.cell(row).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines)


def write_plot(rows: Sequence[Row], path: Path, machine: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed (pip install matplotlib); {path} not written", file=sys.stderr)
        return

    plotted = [r for r in rows if r.impl in ("flash", "sdpa") and r.gflops is not None]
    if not plotted:
        print(f"--plot: no timed flash or sdpa rows; {path} not written", file=sys.stderr)
        return
    # Shapes in the order of N (then of work), one tick each, labelled with the whole shape: two shapes of the
    # same N but different H or d would otherwise sit on one x and read as noise.
    shapes = sorted({r.shape for r in plotted},
                    key=lambda s: (s.seq_len, attention_flops(s, False)))
    x_of = {shape: i for i, shape in enumerate(shapes)}
    series = sorted({(r.threads, r.dtype, r.causal) for r in plotted})
    show_causal = len({causal for _, _, causal in series}) > 1

    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(shapes) + 2), 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (threads, dtype, causal) in enumerate(series):
        label = f"{threads} thread{'s' if threads > 1 else ''}, {dtype}"
        if show_causal:
            label += ", causal" if causal else ", no mask"
        for impl, style, marker in (("flash", "-", "o"), ("sdpa", "--", "s")):
            points = sorted((x_of[r.shape], r.gflops) for r in plotted
                            if (r.impl, r.threads, r.dtype, r.causal) == (impl, threads, dtype, causal))
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, linestyle=style, marker=marker, color=colors[i % len(colors)],
                        label=f"{'cs149gpt flash' if impl == 'flash' else 'torch sdpa'}, {label}")
    ax.set_xticks(range(len(shapes)), [f"N={s.seq_len}\n({s})" for s in shapes])
    ax.set_xlabel("sequence length N (shape B,H,N,d)")
    ax.set_ylabel("GFLOP/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"attention, {machine['cpu_model']}, isa {machine['isa']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def parse_shape(text: str) -> Shape:
    try:
        dims = [int(part) for part in text.split(",")]
    except ValueError:
        dims = []
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"a shape is B,H,N,d with four positive integers, got {text!r}")
    return Shape(*dims)


def parse_list(text: str, parse_item: Callable[[str], object]) -> list:
    items = []
    for part in text.split(","):
        item = parse_item(part.strip())
        if item not in items:
            items.append(item)
    return items


def parse_impl(name: str) -> str:
    if name not in ALL_IMPLS:
        raise argparse.ArgumentTypeError(f"unknown impl {name!r}: choose among {', '.join(ALL_IMPLS)}")
    return name


def parse_threads(text: str) -> int:
    if text == "all":
        return usable_cpus()
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a thread count is a positive integer or 'all', got {text!r}")
    return int(text)


def parse_dtype(name: str) -> torch.dtype:
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}: choose among {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_argument_group("what to run")
    shapes = what.add_mutually_exclusive_group()
    shapes.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                        help="a set of shapes: quick (default, a minute or two on 2 cores) or full (the issue's "
                             "five shapes, up to (1,32,8192,64))")
    shapes.add_argument("--shapes", nargs="+", type=parse_shape, metavar="B,H,N,d",
                        help="shapes to run instead of a preset, e.g. --shapes 1,4,1024,32 1,12,1024,64")
    what.add_argument("--impls", type=lambda t: parse_list(t, parse_impl), default=list(ALL_IMPLS),
                      help=f"comma-separated subset of {','.join(ALL_IMPLS)} (default: all); sdpa is always timed, "
                           "as the reference of ×SDPA and of the output check")
    what.add_argument("--threads", type=lambda t: parse_list(t, parse_threads),
                      default=parse_list("1,all", parse_threads),
                      help="comma-separated thread counts; 'all' is one per CPU this process may use (default: 1,all)")
    what.add_argument("--causal", choices=("off", "on", "both"), default="off",
                      help="without the causal mask, with it, or both (default: off)")
    what.add_argument("--dtype", type=lambda t: parse_list(t, parse_dtype), default=[torch.float32],
                      help=f"comma-separated, among {','.join(DTYPES)} (default: float32); an implementation that "
                           "rejects a dtype is reported as unsupported")

    timing = parser.add_argument_group("timing")
    timing.add_argument("--min-run-time", type=float, default=0.5, metavar="SECONDS",
                        help="measured time per implementation per configuration, split across the rounds "
                             "(default: 0.5)")
    timing.add_argument("--rounds", type=int, default=2,
                        help="interleaved rounds per configuration; each runs the implementations in the reverse "
                             "order of the previous one (default: 2: sdpa, ..., flash, flash, ..., sdpa)")
    # 30 s: enough for flash and sdpa at the full preset's (1,32,8192,64) on 2 cores, while the N²-memory rungs
    # drop out there; an implementation is called about five times per configuration.
    timing.add_argument("--max-call-seconds", type=float, default=30.0, metavar="SECONDS",
                        help="skip an implementation whose single call takes longer, as predicted from its speed "
                             "on an earlier shape (same head dim first) or as measured by its first call "
                             "(default: 30)")
    timing.add_argument("--max-score-mib", type=float, default=512.0, metavar="MIB",
                        help="skip naive and blocked when their N×N float32 score matrix is larger (default: 512)")
    timing.add_argument("--noisy-iqr", type=float, default=0.1, metavar="FRACTION",
                        help="flag a median whose interquartile range exceeds this fraction of it (default: 0.1)")

    output = parser.add_argument_group("output")
    output.add_argument("--memory", action="store_true",
                        help="also measure each implementation's peak extra memory, as torch.profiler sees it "
                             "(one profiled call each)")
    output.add_argument("--markdown", action="store_true", help="print the results again as a Markdown table")
    output.add_argument("--json", type=Path, metavar="PATH", help="save machine info, settings and every row")
    output.add_argument("--plot", type=Path, metavar="PATH",
                        help="save a PNG of GFLOP/s vs N, flash vs sdpa (needs matplotlib)")
    args = parser.parse_args(argv)

    if args.min_run_time <= 0 or args.rounds < 1 or args.max_call_seconds <= 0:
        parser.error("--min-run-time and --max-call-seconds must be > 0, --rounds >= 1")
    if "sdpa" not in args.impls:
        args.impls.insert(0, "sdpa")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    machine = machine_info()

    workloads = [Workload(s) for s in args.shapes] if args.shapes else list(PRESETS[args.preset])
    causal_modes = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    configs = [(workload, Config(workload.shape, causal, dtype, threads))
               for workload in workloads for dtype in args.dtype for causal in causal_modes for threads in args.threads]
    for threads in args.threads:
        if threads > machine["usable_cpus"]:
            print(f"warning: {threads} threads on {machine['usable_cpus']} usable CPUs oversubscribes them",
                  file=sys.stderr)

    load = machine["load_average_at_start"]
    if load is not None and load[0] > 0.5:
        print(f"warning: load average {load[0]:.1f} over the last minute: other processes share the CPUs, so "
              "times will be noisy (interleaving keeps the ×SDPA ratios fairer than the absolute numbers)",
              file=sys.stderr)

    # Measured before any timing, on the same threads the configurations use.
    peaks = {threads: fma_peak_gflops(threads, torch.float32) for threads in args.threads}
    machine["fma_peak_gflops_float32"] = peaks
    if torch.bfloat16 in args.dtype:
        machine["bf16_peak_gflops"] = {threads: fma_peak_gflops(threads, torch.bfloat16) for threads in args.threads}

    print("cs149gpt attention benchmark")
    print(f"  machine : {machine['cpu_model']}, {machine['logical_cpus']} logical CPUs "
          f"({machine['physical_cores'] or '?'} cores, {machine['usable_cpus']} usable), "
          f"{' '.join(machine['simd_flags'])}")
    print(f"  software: torch {machine['torch_version']}, Python {machine['python']}, "
          f"cs149gpt {machine['git_revision'] or '(no git)'} with isa {machine['isa']}")
    print(f"  timing  : torch.utils.benchmark blocked_autorange, {args.min_run_time:g} s per impl per config "
          f"over {args.rounds} interleaved round(s); ms = median")
    print("  impls   : sdpa = F.scaled_dot_product_attention, manual = softmax(q @ kᵀ · scale [+ mask]) @ v; "
          "×SDPA = sdpa time / this time (> 1: faster than sdpa)")
    show_peak = any(peak is not None for peak in peaks.values())
    if show_peak:
        print("  peak    : float32 FMA probe, " + ", ".join(f"{peak:.0f} GFLOP/s on {threads} thread(s)"
                                                          for threads, peak in peaks.items() if peak is not None))
    if machine.get("bf16_peak_gflops"):
        print("  peak    : bf16 dot-product probe (% of peak of bfloat16 rows), " + ", ".join(
            f"{peak:.0f} GFLOP/s on {threads} thread(s)" for threads, peak in machine["bf16_peak_gflops"].items()
            if peak is not None))
    print()

    columns = table_columns(show_peak, args.memory)
    print(text_line(columns, [c.title for c in columns]))
    print(text_line(columns, ["-" * max(c.width, len(c.title)) for c in columns]))

    rows: list[Row] = []
    speeds = SpeedHistory()
    interrupted = False
    try:
        for index, (workload, config) in enumerate(configs, 1):
            wanted = [impl for impl in ALL_IMPLS if impl in args.impls]
            impls = [impl for impl in wanted if workload.only_impls is None or impl in workload.only_impls]
            print(f"[{index}/{len(configs)}] {config.shape} causal={config.causal} {config.dtype_name} "
                  f"threads={config.threads} ...", file=sys.stderr, flush=True)
            config_rows = run_config(config, impls, args, speeds,
                                     not_in_preset=[impl for impl in wanted if impl not in impls])
            rows.extend(config_rows)
            for row in config_rows:
                print(text_line(columns, [c.cell(row) for c in columns]))
            print(flush=True)
    except KeyboardInterrupt:  # keep what was measured: report and save it, then exit as interrupted
        interrupted = True
        print(f"interrupted: reporting the {len({(r.shape, r.causal, r.dtype, r.threads) for r in rows})} "
              "configurations finished so far", file=sys.stderr)

    if args.memory:
        print("peak MiB: the most memory torch's CPU allocator held beyond its start during one call, output "
              "included; memory taken from malloc/new directly (or kept by MKL/oneDNN) is not seen.")
    if args.markdown:
        print()
        print(f"_{machine['cpu_model']}, {machine['usable_cpus']} usable CPUs, torch {machine['torch_version']}, "
              f"isa {machine['isa']}, min-run-time {args.min_run_time:g} s; "
              "×SDPA = sdpa time / this time (> 1: faster than sdpa)._")
        print()
        print(markdown_table(rows, columns))
    if args.json:
        settings = {key: value for key, value in vars(args).items() if key not in ("json", "plot")}
        settings["dtype"] = [str(d).removeprefix("torch.") for d in args.dtype]
        settings["shapes"] = [str(w.shape) for w in workloads]
        document = {
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine,
            "settings": settings,
            "flop_count": "4*B*H*visible_pairs*d (both matrix multiplies; softmax not counted)",
            "results": [{**dataclasses.asdict(r), "shape": dataclasses.asdict(r.shape)} for r in rows],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(rows, args.plot, machine)
    print(f"finished in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 130 if interrupted else 0  # 128 + SIGINT, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
