"""Smoke test of the benchmark suite: benchmarks/bench.py runs, checks its answers and records what it must."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


def run_bench(tmp_path, *args):
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(BENCH), *args, "--quick", "--threads", "1", "--rounds", "2",
                           "--seconds", "0.05", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout


@pytest.mark.parametrize("args, bench, min_rows", [
    (("forward", "--shapes", "1,2,128,32"), "forward", 2),  # causal off and on
    (("decode", "--keys", "256", "--heads", "4,2", "--head-dim", "32"), "decode", 4),  # 2 dtypes x 2 entry points
    # softcap and ALiBi vs plain flash, ALiBi vs SDPA + bias: 3 rows x 2 dtypes x causal off and on
    (("logits", "--shapes", "1,2,128,32"), "logits", 12),
    (("trainpacked",), "trainpacked", 2),  # a tiny Llama, packed vs sdpa padded: float32, bf16 autocast
    # 2 gloo processes vs one: fwd, fwd+bwd x 2 dtypes x ring and usp (one Ulysses group of 2 here)
    (("ring", "--seq", "256", "--algorithm", "ring,usp"), "ring", 8),
])
def test_bench_quick_json(tmp_path, args, bench, min_rows):
    doc, stdout = run_bench(tmp_path, *args)
    machine = doc["machine"]
    assert machine["cpu_model"] and machine["torch"] and machine["date"] and machine["usable_cpus"] >= 1
    assert doc["command"].startswith("python benchmarks/bench.py " + args[0])
    rows = doc["tables"][bench]
    assert len(rows) >= min_rows
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ours_ms"] > 0 and row["peer_ms"] > 0 and row["rate"] > 0
        assert row["ratio"] == pytest.approx(row["peer_ms"] / row["ours_ms"], rel=1e-6)
        assert row["err"] is not None and row["err"] <= 6e-2
    assert "peer/ours" in stdout and machine["cpu_model"] in stdout


def test_bench_markdown_and_cuda_skip(tmp_path):
    """--markdown heads its table with the machine and the command; without a GPU the cuda subcommand says it skips."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the skip path is not taken")
    doc, stdout = run_bench(tmp_path, "cuda", "--markdown", "--suite", "plain,masked,varlen,deterministic,decode")
    rows = doc["tables"]["cuda"]
    assert [r["status"] for r in rows] == ["skipped"] and "no CUDA GPU" in rows[0]["note"]
    assert "`python benchmarks/bench.py cuda --markdown" in stdout and "| peer/ours |" in stdout


def bench_timing(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    import _timing

    return _timing


def test_markdown_tables_read_back(monkeypatch):
    """What markdown_table prints reads back as the same rows: missing times, a skipped row's status, a threads column,
    a '|' in a case; a table after the perf markers is not read."""
    _timing = bench_timing(monkeypatch)
    Row = _timing.Row
    machine = {"gpu": None, "cpu_model": "X", "physical_cores": 2, "logical_cpus": 2, "usable_cpus": 2, "isa": "avx2",
               "torch": "2", "commit": "abc", "date": "2026-01-01"}
    rows = [Row("cpu", "fwd (1,2,3,4) a|b", "float32", 2, "flash", "torch sdpa", 1.5, 3.0, 2.0, note="n"),
            Row("cpu", "decode", "bfloat16", 1, "attention", "torch sdpa", status="skipped", note="no GPU")]
    text = "\n".join(["intro", "<!-- perf:begin -->", _timing.markdown_table(rows, "CPU: t", machine, ["x"]), "",
                      "<!-- perf:end -->", "| case | dtype |", "|:---|:---|", "| other | table |"])
    (line, back), = _timing.tables_from_markdown(text).values()
    assert line.startswith("X (2 cores") and "commit abc" in line
    assert [(r.case, r.threads, r.ours_ms, r.peer_ms, r.ratio, r.status, r.note) for r in back] == [
        ("fwd (1,2,3,4) a|b", 2, 1.5, 3.0, 2.0, "ok", "n"), ("decode", 1, None, None, None, "skipped", "no GPU")]


def test_readme_tables_read_back_and_plot(tmp_path, monkeypatch):
    """The README's tables parse back into rows whose ratio is their peer time over ours (as bench.py printed them),
    each table under its own machine line; `bench.py plot` draws them (where matplotlib is installed)."""
    _timing = bench_timing(monkeypatch)

    readme = (BENCH.parents[1] / "README.md").read_text()
    tables = _timing.tables_from_markdown(readme)
    assert any(t.startswith("CPU") for t in tables) and any(t.startswith("CUDA") for t in tables)
    for title, (machine, rows) in tables.items():
        assert "torch " in machine and "commit " in machine, (title, machine)
        assert len(rows) >= 4, title
        for row in rows:
            assert row.bench == ("cuda" if title.startswith("CUDA") else "cpu")
            assert row.ratio == pytest.approx(row.peer_ms / row.ours_ms, rel=0.02), (title, row)
    pytest.importorskip("matplotlib")
    out = tmp_path / "perf.png"
    done = subprocess.run([sys.executable, str(BENCH), "plot", "--plot", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
