"""What every subcommand of bench.py shares: the machine record, interleaved timing, the answer check, the rows
and their table, Markdown, JSON and plot.

Fairness, the same for every subcommand:
- ours and the peer are timed in the same rounds, each round in the reverse order of the one before, so drift of
  the machine (clock, temperature, a neighbour's burst) lands on both alike; a time is the median over the rounds;
- every callable runs once before timing (the probe call): it warms up, and its answer is checked against the
  peer's (a row that disagrees is still timed, and marked WRONG);
- a median whose interquartile range is over 10 % of it is marked noisy; a row that cannot run says why.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import cs149gpt  # noqa: E402  (the repository root first on sys.path: compiles the kernels on first import)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# Largest |ours - peer| still called a match: a check that catches a wrong kernel, not an accuracy test (tests/ is).
MATCH_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 6e-2, torch.float16: 1e-2}
NOISY_IQR = 0.10


# ------------------------------------------------------------------------------------------------- the machine
def usable_cpus() -> int:
    """The CPUs this process may run on (taskset, a container's cpuset): 'all' threads means one per usable CPU."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _cpuinfo() -> list[dict[str, str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    cpus = []
    for block in text.strip().split("\n\n"):
        cpus.append({key.strip(): value.strip() for key, _, value in (line.partition(":") for line in block.splitlines())})
    return cpus


def _git(*args: str) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_info() -> dict:
    cpus = _cpuinfo()
    flags = set(cpus[0].get("flags", "").split()) if cpus else set()
    cores = {(c.get("physical id"), c.get("core id")) for c in cpus if "core id" in c}
    # BENCH_COMMIT names the commit of a copy of the tree that carries no (or another) git history.
    commit = os.environ.get("BENCH_COMMIT") or _git("rev-parse", "--short", "HEAD")
    if commit and not os.environ.get("BENCH_COMMIT") and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    gpu = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return {
        "cpu_model": cpus[0].get("model name", platform.processor()) if cpus else platform.processor(),
        "physical_cores": len(cores) or None,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "simd_flags": sorted(flags & {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}),
        "isa": cs149gpt.isa(),
        "gpu": gpu,
        "cuda": torch.version.cuda if gpu else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        # Other work on the machine is the first suspect of a noisy run: keep the evidence with it.
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "env": {k: os.environ[k] for k in ("CS149GPT_ISA", "OMP_NUM_THREADS", "OMP_PROC_BIND") if k in os.environ},
    }


def machine_line(machine: dict, device: str = "cpu") -> str:
    if device == "cuda" and machine["gpu"]:
        what = f"{machine['gpu']} (CUDA {machine['cuda']})"
    else:
        cores = machine["physical_cores"] or machine["logical_cpus"]
        what = f"{machine['cpu_model']} ({cores} cores, {machine['usable_cpus']} usable; kernels: {machine['isa']})"
    return f"{what}, torch {machine['torch']}, commit {machine['commit'] or '?'}, {machine['date']}"


def command_line(argv: Sequence[str]) -> str:
    return "python benchmarks/bench.py " + " ".join(shlex.quote(a) for a in argv)


# ------------------------------------------------------------------------------------------------- timing
@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch.set_num_threads also sets the OpenMP thread count that our kernels share."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@dataclasses.dataclass
class Timing:
    median: float  # seconds per call
    iqr: float
    samples: int

    @property
    def noisy(self) -> bool:
        return self.iqr > NOISY_IQR * self.median


def _time_calls(fn: Callable, n: int, sync: Optional[Callable]) -> float:
    """Seconds for n back-to-back calls of fn, the device synchronised before and after."""
    if sync:
        sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    if sync:
        sync()
    return time.perf_counter() - start


def interleave(fns: dict[str, Callable], rounds: int, seconds: float, *, sync: Optional[Callable] = None,
               self_timed: bool = False) -> dict[str, Timing]:
    """Seconds per call of each callable: `rounds` rounds, each of them in the reverse order of the one before, each
    callable running a block of calls that lasts about seconds / rounds; a sample is a block's mean per call.

    sync (e.g. torch.cuda.synchronize) is called before and after each block. With self_timed each callable
    returns the seconds it measured itself (a decode step after an untimed prefill), one call per sample."""
    if not self_timed:
        for fn in fns.values():  # a warm-up call (the probe call came before): caches and pages settle
            fn()
    calls = {}
    for name, fn in fns.items():
        if self_timed:
            calls[name] = 1
            continue
        n = 1
        while True:  # 1, 2, 4, ... calls until they last 5 ms: a µs call is not judged by one preempted call
            elapsed = _time_calls(fn, n, sync)
            if elapsed >= 5e-3 or n >= 1024:
                break
            n *= 2
        calls[name] = int(max(1, min(100_000, seconds / rounds / max(elapsed / n, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for _ in range(rounds):
        for name in order:
            fn, n = fns[name], calls[name]
            if self_timed:
                samples[name].append(float(fn()))
                continue
            samples[name].append(_time_calls(fn, n, sync) / n)
        order.reverse()
    result = {}
    for name, s in samples.items():
        q1, q3 = (statistics.quantiles(s, n=4)[0::2] if len(s) >= 2 else (s[0], s[0]))
        result[name] = Timing(statistics.median(s), max(q3 - q1, 0.0), len(s))
    return result


def max_err(a, b) -> float:
    """Largest |a - b| over tensors or sequences of tensors (NaN if either has a NaN where the other does not)."""
    if isinstance(a, torch.Tensor):
        a, b = (a,), (b,)
    return max(((x.float() - y.float()).abs().max().item() if x.numel() else 0.0) for x, y in zip(a, b))


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:120]


# ------------------------------------------------------------------------------------------------- rows
@dataclasses.dataclass
class Row:
    """One line of a table: ours against the peer on one case, timed in the same rounds."""

    bench: str
    case: str
    dtype: str
    threads: Optional[int]
    ours: str
    peer: str
    ours_ms: Optional[float] = None
    peer_ms: Optional[float] = None
    ratio: Optional[float] = None  # peer time / our time: > 1 = ours faster
    rate: Optional[float] = None  # ours' throughput in `unit`
    unit: str = ""
    err: Optional[float] = None  # largest |ours - peer| of the probe call
    status: str = "ok"  # ok, wrong (timed, but the answer disagrees), skipped, unsupported, error
    note: str = ""

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text


def measured_rows(bench: str, case: str, dtype: str, threads: Optional[int], ours: dict[str, Callable],
                  peer: tuple[str, Callable], args, *, work: Optional[float] = None, unit: str = "",
                  check: Optional[Callable] = None, tolerance: Optional[float] = None,
                  sync: Optional[Callable] = None) -> list[Row]:
    """Probe, check, then time ours (one or several callables) and the peer in the same interleaved rounds.

    work / seconds gives the rate column (e.g. GFLOP, GB); check(ours_out, peer_out) -> error, compared with
    tolerance (default: max |difference| against MATCH_TOLERANCE of the dtype)."""
    peer_name, peer_fn = peer
    rows = {name: Row(bench, case, dtype, threads, name, peer_name, unit=unit) for name in ours}
    ctx = torch_threads(threads) if threads else contextlib.nullcontext()
    with ctx:
        try:
            reference = peer_fn()
        except Exception as e:  # noqa: BLE001  (a peer that cannot run this case: say so, time nothing)
            for row in rows.values():
                row.status, row.note = "skipped", f"{peer_name} fails: {first_line(e)}"
            return list(rows.values())
        timed = {peer_name: peer_fn}
        for name, fn in ours.items():
            row = rows[name]
            try:
                out = fn()
            except TypeError as e:  # how cs149gpt and torch reject a dtype they do not implement
                row.status, row.note = "unsupported", first_line(e)
                continue
            except (RuntimeError, ValueError, MemoryError) as e:
                row.status, row.note = "error", f"{type(e).__name__}: {first_line(e)}"
                continue
            row.err = (check or max_err)(out, reference)
            limit = tolerance if tolerance is not None else MATCH_TOLERANCE.get(DTYPES.get(dtype), 1e-3)
            if not row.err <= limit:  # `not <=` also catches NaN
                row.status = "wrong"
                row.add_note(f"WRONG: error {row.err:.3g} > {limit:g}")
            timed[name] = fn
        del reference
        if len(timed) == 1:
            return list(rows.values())
        times = interleave(timed, args.rounds, args.seconds, sync=sync)
    peer_t = times[peer_name]
    for name, row in rows.items():
        if name not in times:
            continue
        t = times[name]
        row.ours_ms, row.peer_ms, row.ratio = t.median * 1e3, peer_t.median * 1e3, peer_t.median / t.median
        if work is not None:
            row.rate = work / t.median
        for who, tt in ((name, t), (peer_name, peer_t)):
            if tt.noisy:
                row.add_note(f"noisy: {who} IQR {100 * tt.iqr / tt.median:.0f}% of median")
    return list(rows.values())


# ------------------------------------------------------------------------------------------------- output
def _num(value: Optional[float], fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _ms(value: Optional[float]) -> str:
    if value is None:
        return "—"
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.0f}"


COLUMNS = (  # title, cell, left-aligned
    ("case", lambda r: r.case, True),
    ("dtype", lambda r: r.dtype, True),
    ("threads", lambda r: "" if r.threads is None else str(r.threads), False),
    ("ours", lambda r: r.ours, True),
    ("peer", lambda r: r.peer, True),
    ("ours ms", lambda r: _ms(r.ours_ms), False),
    ("peer ms", lambda r: _ms(r.peer_ms), False),
    ("peer/ours", lambda r: _num(r.ratio, ".2f"), False),
    ("ours rate", lambda r: "" if r.rate is None else f"{_num(r.rate, '.1f')} {r.unit}", False),
    ("note", lambda r: r.note if r.status in ("ok", "wrong") else f"{r.status}: {r.note}", True),
)


def _columns(rows: Sequence[Row]):
    cols = [c for c in COLUMNS if c[0] != "threads" or any(r.threads is not None for r in rows)]
    if not any(r.rate is not None for r in rows):
        cols = [c for c in cols if c[0] != "ours rate"]
    return cols


def text_table(rows: Sequence[Row]) -> str:
    cols = _columns(rows)
    cells = [[title for title, _, _ in cols]] + [[cell(r) for _, cell, _ in cols] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    lines = []
    for n, line in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if left else c.rjust(w)
                               for c, w, (_, _, left) in zip(line, widths, cols)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[Row], title: str, machine: dict, argv: Sequence[str], device: str = "cpu") -> str:
    """A README-ready table headed by the machine, torch, commit, date and the command that prints it."""
    cols = _columns(rows)
    head = [f"**{title}** — {machine_line(machine, device)}.", f"`{command_line(argv)}`; peer/ours = peer time / our "
            "time (> 1: ours faster), medians of interleaved rounds.", "",
            "| " + " | ".join(t for t, _, _ in cols) + " |",
            "|" + "|".join(":---" if left else "---:" for _, _, left in cols) + "|"]
    body = ["| " + " | ".join(cell(r).replace("|", "\\|") for _, cell, _ in cols) + " |" for r in rows]
    return "\n".join(head + body)


def write_json(path: Path, machine: dict, argv: Sequence[str], tables: dict[str, list[Row]]) -> None:
    document = {"machine": machine, "command": command_line(argv),
                "tables": {name: [dataclasses.asdict(r) for r in rows] for name, rows in tables.items()}}
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"results written to {path}", file=sys.stderr)


def tables_from_markdown(text: str) -> dict[str, tuple[str, list[Row]]]:
    """The tables markdown_table printed, read back from text (the README's, between its perf markers where it has
    them): {title: (its machine line, rows)}. A missing number (—) reads as None, a "skipped: ..." note as the status."""
    begin, end = text.find("<!-- perf:begin -->"), text.find("<!-- perf:end -->")
    if 0 <= begin < end:
        text = text[begin:end]
    tables: dict[str, tuple[str, list[Row]]] = {}
    title, header, rows = None, None, []
    for line in text.splitlines():
        heading = re.match(r"\*\*(.+?)\*\* — (.+?)\.?$", line)
        if heading:
            title, header, rows = heading.group(1), None, []
            tables[title] = (heading.group(2), rows)
            continue
        if title is None:
            continue
        if not line.startswith("|"):
            if header is not None:  # the table has ended
                title = None
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        if header is None:
            header = cells
            continue
        if all(set(c) <= set(":-") for c in cells):  # the alignment row
            continue
        cell = dict(zip(header, cells))
        status, note = "ok", cell.get("note", "")
        prefixed = re.match(r"(skipped|unsupported|error): (.*)$", note)
        if prefixed:
            status, note = prefixed.groups()
        number = lambda key: float(cell[key]) if cell.get(key, "") not in ("", "—") else None  # noqa: E731
        rows.append(Row("cuda" if title.startswith("CUDA") else "cpu", cell["case"], cell["dtype"],
                        int(cell["threads"]) if cell.get("threads") else None, cell["ours"], cell["peer"],
                        number("ours ms"), number("peer ms"), number("peer/ours"), status=status, note=note))
    return tables


def write_plot(path: Path, machine: Optional[dict], tables: dict[str, list[Row]],
               headings: Optional[dict[str, str]] = None) -> None:
    """Horizontal bars of peer/ours per row (1 = as fast as the peer, log scale), one panel per table. headings: a
    machine line per table (tables measured on different machines or commits), in place of one for the figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print(f"--plot: matplotlib is not installed (pip install matplotlib); {path} not written", file=sys.stderr)
        return
    panels = {name: [r for r in rows if r.ratio is not None] for name, rows in tables.items()}
    panels = {name: rows for name, rows in panels.items() if rows}
    if not panels:
        print(f"--plot: no timed rows; {path} not written", file=sys.stderr)
        return
    heights = [0.35 * len(rows) + 1.0 for rows in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (name, rows) in zip(axes[:, 0], panels.items()):
        labels = [f"{r.case}, {r.dtype}, {r.ours} vs {r.peer}" for r in rows]
        # Bars from 1 (as fast as the peer) on a log scale: 2x faster and 2x slower are as long.
        ax.barh(range(len(rows)), [r.ratio - 1 for r in rows], left=1,
                color=["C0" if r.ratio >= 1 else "C3" for r in rows])
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}x"))
        ax.set_xlim(min(0.5, min(r.ratio for r in rows) / 1.2), max(2.0, max(r.ratio for r in rows) * 1.2))
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("peer time / our time (> 1: ours faster)")
        ax.set_title(f"{name}\n{headings[name]}" if headings else name, fontsize=9)
    if not headings:
        device = "cuda" if any(r.bench == "cuda" for rows in panels.values() for r in rows) else "cpu"
        fig.suptitle(machine_line(machine, device), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------- memory
@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    # Kineto writes "profiler_start/stop" lines straight to file descriptor 2 on every profile.
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_allocator_mib(run: Callable[[], object]) -> Optional[float]:
    """The most MiB torch's CPU allocator held beyond its start during one call of run(), output included, from
    torch.profiler's memory events in time order. Memory a kernel takes from malloc itself, or that MKL/oneDNN keep,
    is not seen (our workspaces come from torch's allocator or are reported to it). None without such events."""
    from torch.profiler import ProfilerActivity, profile

    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:
        return None
    held = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events
                            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU):
        held += nbytes
        peak = max(peak, held)
    return peak / 2**20
