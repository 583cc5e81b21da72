"""The driver, cs149gpt/gpt149.py, end to end at small shapes.

A few runs go through a subprocess, exactly as a student types them (from the repo root and from cs149gpt/);
the rest call main() in-process, because each fresh interpreter pays several seconds for torch and the
profiler's start-up and this file should stay well under a minute.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import cs149gpt  # noqa: E402
from cs149gpt import gpt149  # noqa: E402

SMALL = ["-N", "64", "--repeats", "1"]
CHECK_PASSED = "manual attention == pytorch attention True"


@pytest.fixture(autouse=True)
def keep_thread_count():
    """main() applies --threads to the whole process; put it back for the tests that follow."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_script(*args, cwd=REPO_ROOT):
    script = "gpt149.py" if Path(cwd) == REPO_ROOT / "cs149gpt" else "cs149gpt/gpt149.py"
    return subprocess.run([sys.executable, script, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_all_from_repo_root():
    result = run_script("all", *SMALL)
    assert result.returncode == 0, result.stdout + result.stderr
    for part in range(5):
        assert f"Running Part {part} Test" in result.stdout
    assert result.stdout.count(CHECK_PASSED) == 4
    assert "Summary:" in result.stdout
    assert "FAIL" not in result.stdout


def test_flash_entry_point_from_package_dir_with_odd_tiles():
    # Explicit Br x Bc with the assignment's math goes through myFlashAttention; 3 and 17 divide nothing.
    result = run_script("part4", *SMALL, "-br", "3", "-bc", "17", cwd=REPO_ROOT / "cs149gpt")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "calling cs149gpt.myFlashAttention with Br=3, Bc=17" in result.stdout
    assert CHECK_PASSED in result.stdout


def test_4d_access_script():
    result = run_script("4Daccess", "-B", "2", "-H", "3", "-N", "50", "-d", "7")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fourDimRead == tensor indexing True" in result.stdout
    assert "twoDimRead == tensor indexing True" in result.stdout


INFERENCE = ["--inference", "--tokens", "40", "--repeats", "1", "--threads", "1"]


def test_inference_streams_text_then_compares_with_sdpa():
    result = run_script("part4", *INFERENCE, "-m", "shakes256", "--prompt", "ROMEO:", "--seed", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Running inference using model shakes256" in out and "attention: part4 (cs149gpt flash)" in out
    sample = out.split("-" * 20)[1]
    assert sample.startswith("\nROMEO:") and len(sample.strip()) > len("ROMEO:")
    assert "part4 cs149gpt flash" in out and "part0 PyTorch SDPA" in out and "flash / SDPA:" in out
    assert "tokens/s" in out


@pytest.mark.parametrize("part", ["part0", "part3"])
def test_inference_is_the_same_text_for_a_seed(part, capsys):
    def sample():
        assert gpt149.main([part, *INFERENCE, "--seed", "5"]) == 0
        return capsys.readouterr().out.split("-" * 20)[1]

    first = sample()
    assert first == sample() and first.strip()


def test_inference_lists_the_models(capsys):
    assert gpt149.main(["part4", "--inference", "-m", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("shakes128", "shakes256", "shakes1024", "shakes2048"))
    assert gpt149.main(["part4", "--inference", "-m", "shakes99"]) == 2
    err = capsys.readouterr().err
    assert "no model 'shakes99'" in err and "shakes2048" in err


def test_inference_refuses_unknown_characters(capsys):
    assert gpt149.main(["part4", *INFERENCE, "--prompt", "#"]) == 1
    assert "not in the model's vocabulary: '#'" in capsys.readouterr().err


@pytest.mark.parametrize("part", ["part0", "part1", "part2", "part3", "part4"])
def test_each_part(part, capsys):
    assert gpt149.main([part, *SMALL]) == 0
    out = capsys.readouterr().out
    assert "REFERENCE - " in out and "cpu time:" in out and "mem usage:" in out
    if part != "part0":
        assert CHECK_PASSED in out
        assert "STUDENT - " in out


@pytest.mark.parametrize("part", ["part1", "part2", "part3", "part4"])
def test_causal_goes_through_the_general_operator(part, capsys):
    # -N 61 and the odd tiles leave ragged last tiles on both sides of the causal diagonal.
    assert gpt149.main([part, "-N", "61", "-d", "17", "-B", "2", "-H", "3", "--repeats", "1", "--causal",
                        "-br", "17", "-bc", "3"]) == 0
    out = capsys.readouterr().out
    assert "calling cs149gpt.attention(" in out and "is_causal=True" in out
    assert CHECK_PASSED in out


def test_part4_teaching_checks_the_readable_kernel(capsys):
    """--teaching runs impl='flash_teaching' beside PyTorch (ragged tiles, causal); plain part4 times the fast one."""
    assert gpt149.main(["part4", "-N", "61", "-d", "17", "-B", "2", "-H", "3", "--repeats", "1", "--causal",
                        "-br", "7", "-bc", "5", "--teaching"]) == 0
    out = capsys.readouterr().out
    assert "Flash Attention (teaching kernel)" in out and CHECK_PASSED in out
    assert "calling cs149gpt.attention(impl='flash_teaching', scale=1, is_causal=True, block_q=7, block_k=5)" in out
    assert gpt149.main(["part4", *SMALL, "--teaching"]) == 0  # the assignment's math: still the teaching kernel
    out = capsys.readouterr().out
    assert "impl='flash_teaching'" in out and CHECK_PASSED in out
    assert gpt149.main(["part4", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "impl='flash'" in out and "flash_teaching" not in out and CHECK_PASSED in out


def test_scale_goes_through_the_general_operator(capsys):
    assert gpt149.main(["part3", *SMALL, "--scale", "0.125", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "calling cs149gpt.attention(impl='fused', scale=0.125" in out
    assert CHECK_PASSED in out


def test_a_wrong_kernel_fails_with_the_error_and_exit_code_1(monkeypatch, capsys):
    def off_by_a_little(Q, K, V, *unused):
        return torch.softmax(Q @ K.transpose(-2, -1), dim=-1) @ V + 1e-3

    monkeypatch.setattr(cs149gpt, "myFusedAttention", off_by_a_little, raising=False)
    assert gpt149.main(["part3", *SMALL]) == 1
    captured = capsys.readouterr()
    assert "manual attention == pytorch attention False" in captured.out
    assert "FAILED: part3" in captured.out and "max abs error 0.001" in captured.out
    assert "FAILED: part3: output differs from the PyTorch reference" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["part1", "-N", "0"], "argument -N: expected a positive integer, got 0"),
    (["part4", "-br", "x"], "argument -br: expected a positive integer, got 'x'"),
    (["part9"], "invalid choice: 'part9'"),
    ([], "choose what to run"),
    (["part1", "-N", "100000000"], "more than this machine's"),
    (["all", "--inference"], "--inference runs one part"),
    (["part4", "--inference", "--tokens", "0"], "argument --tokens: expected a positive integer, got 0"),
    (["part3", "--teaching"], "--teaching runs part4 on the CPU"),
])
def test_usage_errors_are_argparse_messages(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpt149.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
