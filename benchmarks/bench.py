#!/usr/bin/env python3
"""cs149gpt's benchmark suite: ours against PyTorch, timed in the same run.

    python benchmarks/bench.py summary --markdown        # the README's tables for this machine
    python benchmarks/bench.py forward --dtype float32,bfloat16 --threads 1,all
    python benchmarks/bench.py decode --quick --json out.json --plot out.png
    python benchmarks/bench.py SUBCOMMAND --help         # its own options

Subcommands:
    summary   the README's rows: CPU forward (float32, bfloat16; causal or not), backward, decode vs torch SDPA; packed
              sequences (varlen), softcap and ALiBi;
              with a GPU, the CUDA forward and backward vs cuDNN, masked attention, packed sequences and decoding
    ladder    every rung (naive, blocked, fused, flash_teaching, flash) vs torch SDPA
    forward   the flash forward vs torch SDPA (--peer manual: the textbook softmax(q kᵀ) v)
    backward  the flash backward alone and forward + backward vs torch SDPA's
    decode    one new query against a KV cache, GQA (attention() and attention_with_kvcache()) vs torch SDPA
    varlen    packed sequences of mixed lengths (16 of 64..2048) vs the batch padded with a mask: torch SDPA, ours
    logits    softcap and ALiBi slopes in the flash forward vs the plain flash forward (their cost), and ALiBi vs
              torch SDPA given the materialised (1, H, N, N) bias
    masks     the masks real models pass vs torch SDPA with the same mask
    models    Hugging Face Llama, GPT-2, BERT of random weights, attention "cs149gpt" vs "sdpa" (needs transformers)
    generate  the shipped GPT's prefill and decode in tokens/s, flash vs sdpa (--llama: a Llama-shaped model)
    train     training steps of cs149gpt/model.py, flash vs sdpa
    trainpacked  padding-free training steps of a Llama (DataCollatorWithFlattening, our varlen through
              transformers' flash path) vs "sdpa" on the same sequences padded, tokens/s of real tokens
    cuda      the CUDA kernels vs each torch SDPA backend (cuDNN, flash, efficient, math); skipped without a GPU;
              --suite masked,varlen,deterministic,decode: masked attention, packed sequences, the backward in
              torch's deterministic mode, KV-cache decoding (bench_cuda.py)
    ring      context-parallel ring attention (cs149gpt.distributed) over W gloo processes vs one process with all
              threads; --device cuda: W GPUs (NCCL) vs one GPU at the same per-GPU length, and vs torch's
              context_parallel; --algorithm ring,ulysses,usp: the other routes too
    tiles     the flash kernel under each block_q x block_k vs its default and torch SDPA (cuda --configs: on the GPU)
    plot      docs/perf.png redrawn from the README's tables (each panel headed by its table's machine and commit)

Every row: ours, the peer, their median times over interleaved rounds (each round in the reverse order of the one
before), and peer/ours = peer time / our time (> 1: ours faster). Every callable runs once first and its answer is
checked against the peer's (a disagreeing row is marked WRONG); noise (IQR > 10 % of the median) and skips are said
in the note column. The machine (CPU model and cores, GPU, torch, commit, date) heads the output and the JSON.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing  # noqa: E402  (puts the repository root on sys.path, imports cs149gpt)
import bench_cpu  # noqa: E402
import bench_cuda  # noqa: E402
import bench_models  # noqa: E402
import bench_ring  # noqa: E402
from _timing import DTYPE_ALIASES, DTYPES, Row  # noqa: E402

import torch  # noqa: E402


# ------------------------------------------------------------------------------------------------- summary
def summary_cpu(args) -> list[Row]:
    """At most 8 rows: forward float32 and bfloat16, without and with the causal mask; backward of both dtypes,
    causal; decode of both dtypes (batch 1, Llama-3-8B's heads)."""
    threads = args.threads[0]
    shape = (1, 8, 1024, 64) if args.quick else (1, 16, 4096, 128)
    keys = 1024 if args.quick else 4096
    rows = []
    for dtype in ("float32", "bfloat16"):
        for causal in (False, True):
            for row in bench_cpu.forward_rows(shape, causal, dtype, threads, args):
                row.case = f"forward {row.case}"
                rows.append(row)
    for dtype in ("float32", "bfloat16"):
        for row in bench_cpu.backward_rows(shape, True, dtype, threads, args, phases=("bwd",)):
            row.case = row.case.replace("bwd", "backward", 1)
            rows.append(row)
    for dtype in ("float32", "bfloat16"):
        for row in bench_cpu.decode_rows(1, keys, dtype, threads, args, kvcache=False):
            row.case = f"decode {row.case}"
            rows.append(row)
    return rows


def summary_cuda(args) -> list[Row]:
    """14 rows, bfloat16: forward and backward, causal and not, vs cuDNN; masked attention (key padding, padded
    causal; forward, and forward and backward) vs SDPA's default given the mask; packed sequences vs cuDNN on the padded
    batch and vs our padded call; decoding (batch 8 and 64, 8192 cached keys) vs SDPA's fastest backend."""
    if not torch.cuda.is_available():
        return bench_cuda.run_cuda(args)
    shape = (4, 16, 16, 1024, 128) if args.quick else (2, 16, 16, 8192, 128)
    args.backends = ["cudnn"]
    peak = bench_cuda.matmul_peak()
    rows = [row for causal in (False, True) for row in bench_cuda.case_rows("bfloat16", shape, causal, args, peak)]
    rows += bench_cuda.masked_rows(args, sizes=(4096,))
    rows += bench_cuda.varlen_rows(args, sizes=(4096,))
    return rows + bench_cuda.decode_rows(args, bench_cuda.copy_bandwidth(), cases=((8, 8192), (64, 8192)))


def summary_flash_attn(args) -> list[Row]:
    """6 rows: packed sequences (varlen, 16 of 64..2048) vs torch SDPA on the batch padded with a mask, forward in
    float32 and bfloat16, forward + backward in bfloat16; bfloat16 causal softcap and ALiBi vs the plain kernel, ALiBi
    vs SDPA given the materialised bias."""
    threads = args.threads[0]
    lengths = bench_cpu.varlen_lengths(8, 32, 512) if args.quick else bench_cpu.varlen_lengths(16, 64, 2048)
    rows = []
    for dtype, backward in (("float32", False), ("bfloat16", False), ("bfloat16", True)):
        rows += [r for r in bench_cpu.varlen_rows(lengths, 16, 64, dtype, threads, args, backward)
                 if r.ours == "varlen"]
    args.softcap = 50.0  # Gemma 2's
    shape = (1, 8, 512, 64) if args.quick else (1, 16, 2048, 64)
    return rows + bench_cpu.logits_rows(shape, True, "bfloat16", threads, args)


def run_summary(args) -> dict[str, list[Row]]:
    tables = {}
    if args.device in ("cpu", "all"):
        tables["CPU: forward, backward and decode vs torch SDPA"] = summary_cpu(args)
        tables["CPU: packed sequences, softcap and ALiBi vs torch SDPA"] = summary_flash_attn(args)
    if args.device in ("cuda", "all"):
        tables["CUDA: forward, backward, masks, packed sequences and decode vs torch SDPA"] = summary_cuda(args)
    return tables


def run_plot(args) -> int:
    """The README's tables (between its perf markers) as bars, each panel under its own table's machine line."""
    tables = _timing.tables_from_markdown(args.readme.read_text())
    if not tables:
        print(f"plot: no benchmark tables in {args.readme}", file=sys.stderr)
        return 1
    _timing.write_plot(args.plot, None, {t: rows for t, (_, rows) in tables.items()},
                       headings={t: line for t, (line, _) in tables.items()})
    return 0


# ------------------------------------------------------------------------------------------------- command line
def parse_threads(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        n = _timing.usable_cpus() if part == "all" else int(part)
        if n < 1:
            raise argparse.ArgumentTypeError(f"a thread count is a positive integer or 'all', got {part!r}")
        out.append(n)
    return out


def parse_dtypes(text: str) -> list[str]:
    names = [DTYPE_ALIASES.get(x, x) for x in text.split(",")]
    for name in names:
        if name not in DTYPES:
            raise argparse.ArgumentTypeError(f"unknown dtype {name!r}: choose among {', '.join(DTYPES)}")
    return names


def parse_shape(text: str) -> tuple:
    dims = tuple(int(x) for x in text.split(","))
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"a shape is B,H,N,d (four positive integers), got {text!r}")
    return dims


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    what = common.add_argument_group("what to run")
    what.add_argument("--threads", type=parse_threads, default=None,
                      help="comma list of thread counts; 'all' = every usable CPU (default: all)")
    what.add_argument("--dtype", type=parse_dtypes, default=None,
                      help=f"comma list of {','.join(DTYPES)} (default: the subcommand's)")
    what.add_argument("--shapes", nargs="+", type=parse_shape, metavar="B,H,N,d", help="instead of the presets")
    what.add_argument("--causal", choices=("off", "on", "both"), default=None, help="(default: the subcommand's)")
    what.add_argument("--quick", action="store_true", help="few shapes, few rounds: a smoke run (CI, a 2-core machine)")
    timing = common.add_argument_group("timing")
    timing.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 3)")
    timing.add_argument("--seconds", type=float, default=None,
                        help="measured seconds per callable per row, over all rounds (default 1; --quick 0.15)")
    output = common.add_argument_group("output")
    output.add_argument("--json", type=Path, metavar="FILE", help="write the machine, the command and every row")
    output.add_argument("--markdown", action="store_true",
                        help="print README-ready tables headed by machine, torch, commit, date and command")
    output.add_argument("--plot", type=Path, metavar="FILE.png", help="a bar chart of peer/ours (needs matplotlib)")

    top = argparse.ArgumentParser(prog="bench.py", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    p = sub.add_parser("summary", parents=[common], help="the README's tables for this machine")
    p.set_defaults(run=run_summary)
    p.add_argument("--device", choices=("cpu", "cuda", "all"), default=None,
                   help="which table (default: cpu, and cuda too where there is a GPU)")
    root = Path(__file__).resolve().parents[1]
    p = sub.add_parser("plot", help="docs/perf.png from the README's tables")
    p.add_argument("--readme", type=Path, default=root / "README.md", help="the tables' file (default: README.md)")
    p.add_argument("--plot", type=Path, default=root / "docs" / "perf.png", metavar="FILE.png",
                   help="the figure (default: docs/perf.png; needs matplotlib)")
    bench_cpu.register(sub, common)
    bench_models.register(sub, common)
    bench_cuda.register(sub, common)
    bench_ring.register(sub, common)
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.command == "plot":  # (nothing timed: no machine header)
        return run_plot(args)
    args.threads = args.threads or [_timing.usable_cpus()]
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.seconds = args.seconds or (0.15 if args.quick else 1.0)
    if args.command == "summary" and args.device is None:
        args.device = "all" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    machine = _timing.machine_info()
    device = "cuda" if args.command == "cuda" or getattr(args, "device", None) == "cuda" else "cpu"
    print(f"# {_timing.machine_line(machine, device)}")
    print(f"# {_timing.command_line(argv)}")
    if machine["load_average"] is not None and machine["load_average"] > 0.5 * machine["usable_cpus"]:
        print(f"warning: load average {machine['load_average']:.1f} on {machine['usable_cpus']} CPUs: other work "
              "shares them; the same-run ratios stay fairer than the absolute times", file=sys.stderr)
    for n in args.threads:
        if n > machine["usable_cpus"]:
            print(f"warning: {n} threads on {machine['usable_cpus']} usable CPUs oversubscribes them", file=sys.stderr)

    result = args.run(args)
    tables = result if isinstance(result, dict) else {args.command: result}
    for title, rows in tables.items():
        print(f"\n## {title}\n")
        print(_timing.text_table(rows))
    if args.markdown:
        for title, rows in tables.items():
            print()
            print(_timing.markdown_table(rows, title, machine, argv, "cuda" if title.startswith("CUDA") or
                                         args.command == "cuda" else "cpu"))
    if args.json:
        _timing.write_json(args.json, machine, argv, tables)
    if args.plot:
        _timing.write_plot(args.plot, machine, tables)
    print(f"finished in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 1 if any(r.status == "wrong" for rows in tables.values() for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
