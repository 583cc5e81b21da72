#!/usr/bin/env python3
"""The cs149gpt driver: checks each attention kernel against PyTorch and profiles both, as CS149's gpt149.py does.

    python cs149gpt/gpt149.py part0                   the PyTorch reference alone, profiled
    python cs149gpt/gpt149.py part1 | part2 | part3   naive, blocked, fused: checked against PyTorch, profiled
    python cs149gpt/gpt149.py part4 -br 64 -bc 128    flash, with a Br x Bc tile (default: the kernel's own)
    python cs149gpt/gpt149.py part4 --teaching        the readable flash kernel (csrc/kernels/flash_teaching.cpp,
                                                      the paper's Algorithm 1 in ~100 lines) instead of the fast one
    python cs149gpt/gpt149.py 4Daccess                fourDimRead / twoDimRead against tensor indexing
    python cs149gpt/gpt149.py all                     part0..part4, then one summary table
    python cs149gpt/gpt149.py part4 --device cuda     flash on the GPU (float32: the teaching kernel; --dtype bfloat16
                                                      or float16: FlashAttention-2 on tensor cores), checked against
                                                      PyTorch SDPA on the GPU, timed with CUDA events
    python cs149gpt/gpt149.py part4 --inference       a shipped GPT writes Shakespeare through flash attention,
                                                      then its tokens/s against PyTorch SDPA (-m list: the models)

Shape: -N (sequence length), -d (head dim), -B (batch), -H (heads); defaults 1024, 32, 1, 4 as upstream.
--threads sets torch.set_num_threads, which the kernels' OpenMP loops obey; --causal adds the causal mask.

The assignment's math is O = softmax(Q Kᵀ) V: scale 1, no mask, and its entry points (myNaiveAttention, ...)
take exactly that. With --causal or --scale other than 1 the driver calls cs149gpt.attention(impl=...) instead.
Exit status: 0 when every check passes, 1 when one fails, 2 for a usage error.
"""
import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, List, Optional

# The package is this file's directory; put its parent first on sys.path so that `import cs149gpt` finds this
# checkout whether the script runs from the repo root, from cs149gpt/, or with another copy installed.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import cs149gpt  # noqa: E402

SEED = 0
# Upstream's tolerance (atol); rtol made explicit rather than torch's default 1e-5.
ATOL = RTOL = 1e-4
PROFILER_ROWS = 10


@dataclass(frozen=True)
class Part:
    name: str  # the subcommand
    title: str  # upstream's "Running Part N Test: <title>"
    label: str  # the record_function name: "REFERENCE - <label>", "STUDENT - <label>"
    impl: Optional[str]  # the cs149gpt kernel; None for part0, which is PyTorch only
    entry_point: Optional[str]  # the assignment's function for that kernel


PARTS = {
    p.name: p
    for p in (
        Part("part0", "PyTorch Matmul + Softmax", "PYTORCH ATTENTION", None, None),
        Part("part1", "Naive Unfused Attention", "NAIVE ATTENTION", "naive", "myNaiveAttention"),
        Part("part2", "Unfused Attention with Blocked Matmul", "BLOCKED MATMUL + UNFUSED SOFTMAX", "blocked",
             "myUnfusedAttentionBlocked"),
        Part("part3", "Fused Attention", "FUSED ATTENTION", "fused", "myFusedAttention"),
        Part("part4", "Flash Attention", "FLASH ATTENTION", "flash", "myFlashAttention"),
    )
}


@dataclass(frozen=True)
class Config:
    B: int
    H: int
    N: int
    d: int
    scale: float
    causal: bool
    br: Optional[int]  # flash's Br (query rows per tile); None: the kernel's default
    bc: Optional[int]  # flash's Bc (key rows per tile)

    @property
    def assignment_math(self) -> bool:
        """Whether this is the assignment's softmax(Q Kᵀ) V, which its entry points compute."""
        return self.scale == 1.0 and not self.causal

    def flops(self) -> int:
        """Multiply-adds of Q Kᵀ and P V, two flops each, over the (query, key) pairs the mask keeps."""
        pairs = self.N * (self.N + 1) // 2 if self.causal else self.N * self.N
        return 4 * self.B * self.H * pairs * self.d


@dataclass
class Measurement:
    """One profiled call (its output and what the profiler saw of it), then the median of a few plain calls."""
    output: torch.Tensor
    wall_s: float  # the profiled call, by the clock (upstream's "Manual Execution Time")
    cpu_ms: float  # the profiled call: cpu_time_total of its record_function row
    mem_bytes: int  # that row's cpu_memory_usage: bytes allocated minus bytes freed within it (upstream's number)
    peak_bytes: Optional[int]  # the high-water mark of those allocations; None if this torch hides the events
    table: str
    median_ms: float  # of --repeats calls outside the profiler: one call's time is at the mercy of the machine
    repeats: int


@dataclass
class PartResult:
    part: Part
    implementation: str
    stats: Measurement
    passed: bool


# ---------------------------------------------------------------------------------------------------------
# Inputs, the reference, and the kernel under test
# ---------------------------------------------------------------------------------------------------------
def make_qkv(cfg: Config):
    """Q, K, V of shape (B, H, N, d), uniform in [0, 1) like upstream's inputs; the same for every part."""
    gen = torch.Generator().manual_seed(SEED)
    return tuple(torch.rand(cfg.B, cfg.H, cfg.N, cfg.d, generator=gen) for _ in range(3))


def reference_attention(Q, K, V, scale: float, causal: bool) -> torch.Tensor:
    """Upstream's reference, matmul, softmax, matmul, written out so the profiler shows each op's cost."""
    scores = Q @ K.transpose(-2, -1)  # (B, H, N, N): the memory that parts 3 and 4 avoid
    if scale != 1.0:
        scores.mul_(scale)
    if causal:
        n_q, n_k = scores.shape[-2:]
        scores.masked_fill_(torch.ones(n_q, n_k, dtype=torch.bool).triu_(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ V


@dataclass(frozen=True)
class KernelCall:
    run: Callable[[], torch.Tensor]
    function: str  # the cs149gpt function it calls
    description: str  # that call as the user should see it


def kernel_call(part: Part, cfg: Config, Q, K, V) -> KernelCall:
    """How to run our kernel for `part`.

    The assignment's entry point when it computes what was asked (scale 1, no mask, and for flash an explicit
    Br x Bc), so that its path is exercised; otherwise the general operator, cs149gpt.attention.
    """
    B, H, N, d = cfg.B, cfg.H, cfg.N, cfg.d
    # The entry points keep upstream's scratch arguments but our kernels allocate their own: any tensor will do.
    unused = torch.empty(0)
    if cfg.assignment_math and part.impl not in ("flash", "flash_teaching"):
        fn = getattr(cs149gpt, part.entry_point)
        return KernelCall(lambda: fn(Q, K, V, unused, B, H, N, d), part.entry_point,
                          f"cs149gpt.{part.entry_point}")
    if cfg.assignment_math and cfg.br is not None and cfg.bc is not None and part.impl == "flash":
        fn = cs149gpt.myFlashAttention
        scratch = [unused] * 11  # Qi, Kj, Vj, Sij, Pij, PV, Oi, L, Li, Lij, Lnew
        return KernelCall(lambda: fn(Q, K, V, *scratch, cfg.bc, cfg.br, B, H, N, d), "myFlashAttention",
                          f"cs149gpt.myFlashAttention with Br={cfg.br}, Bc={cfg.bc}")
    blocks = {}
    if part.impl in ("flash", "flash_teaching"):
        blocks = {"block_q": cfg.br, "block_k": cfg.bc}  # None keeps the kernel's default
    arguments = f"impl={part.impl!r}, scale={cfg.scale:g}, is_causal={cfg.causal}" + \
        "".join(f", {name}={'default' if size is None else size}" for name, size in blocks.items())
    return KernelCall(lambda: cs149gpt.attention(Q, K, V, impl=part.impl, scale=cfg.scale, is_causal=cfg.causal,
                                                 **blocks), "attention", f"cs149gpt.attention({arguments})")


# ---------------------------------------------------------------------------------------------------------
# Profiling
# ---------------------------------------------------------------------------------------------------------
def peak_allocated_bytes(prof: profile) -> Optional[int]:
    """The most memory held at once by allocations made inside the profile, counting from zero.

    key_averages() keeps only each row's net sum (allocations minus frees), which is the output's size for
    every part here; the peak is what tells an N x N score matrix from an O(N) scratch. It comes from the
    profiler's raw "[memory]" events, which only the Kineto results expose. The profiler sees allocations made
    through PyTorch's allocator only: the small per-thread scratch that fused and flash keep in a std::vector
    (a score row, or a Br x Bc tile and its Br x d output, per thread) is not in it.
    """
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        return None
    deltas = sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in deltas:
        held += nbytes
        peak = max(peak, held)
    return peak


def measure(fn: Callable[[], torch.Tensor], label: str, repeats: int) -> Measurement:
    fn()  # warm up: the first call may compile the kernels, fault in pages, start OpenMP's threads
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        with record_function(label):
            start = time.perf_counter()
            output = fn()
            wall_s = time.perf_counter() - start
    averages = prof.key_averages()
    row = next(r for r in averages if r.key == label)

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return Measurement(output=output, wall_s=wall_s, cpu_ms=row.cpu_time_total / 1000.0,
                       mem_bytes=int(row.cpu_memory_usage), peak_bytes=peak_allocated_bytes(prof),
                       table=averages.table(sort_by="cpu_time_total", row_limit=PROFILER_ROWS),
                       median_ms=statistics.median(times) * 1e3, repeats=repeats)


def print_statistics(label: str, stats: Measurement) -> None:
    print(stats.table)
    print(f"{label} statistics")
    print(f"cpu time:  {stats.cpu_ms:.3f}ms")
    print(f"mem usage:  {stats.mem_bytes} bytes")
    if stats.peak_bytes is not None:
        print(f"peak mem:  {stats.peak_bytes} bytes ({mib(stats.peak_bytes)} MiB)")
    print(f"median time of {stats.repeats} unprofiled calls:  {stats.median_ms:.3f}ms")
    print()


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


# ---------------------------------------------------------------------------------------------------------
# The subcommands
# ---------------------------------------------------------------------------------------------------------
def run_part(part: Part, cfg: Config, repeats: int) -> PartResult:
    print(f"\nRunning {part.name.replace('part', 'Part ')} Test: {part.title}\n")
    Q, K, V = make_qkv(cfg)

    print("-----RUNNING REFERENCE IMPLEMENTATION-----\n")
    reference_label = f"REFERENCE - {part.label}"
    reference = measure(lambda: reference_attention(Q, K, V, cfg.scale, cfg.causal), reference_label, repeats)
    print_statistics(reference_label, reference)
    if part.impl is None:
        return PartResult(part, "PyTorch: matmul, softmax, matmul", reference, passed=True)

    print("-----RUNNING STUDENT IMPLEMENTATION-----\n")
    call = kernel_call(part, cfg, Q, K, V)
    print(f"calling {call.description}")
    label = f"STUDENT - {part.label}"
    ours = measure(call.run, label, repeats)
    passed = torch.allclose(ours.output, reference.output, atol=ATOL, rtol=RTOL)
    error = (ours.output - reference.output).abs()
    max_error = error.max().item()
    print(f"manual attention == pytorch attention {passed} (max abs error {max_error:.3g})")
    if not passed:
        where = tuple(int(i) for i in torch.unravel_index(error.nan_to_num(float("inf")).argmax(), error.shape))
        print(f"FAILED: {part.name} ({call.description}) differs from PyTorch: max abs error {max_error:.3g} at "
              f"(b, h, i, j) = {where}, more than atol={ATOL:g} + rtol={RTOL:g} * |reference|")
    print(f"Manual Execution Time:  {ours.wall_s:.6f}\n")
    print_statistics(label, ours)
    return PartResult(part, f"{part.impl} via {call.function}", ours, passed)


def run_4d_access(cfg: Config) -> bool:
    """fourDimRead and twoDimRead, row-major indexing into a flattened list, against tensor indexing."""
    print("\nRunning 4D Access Test: fourDimRead / twoDimRead\n")
    Q, _, _ = make_qkv(cfg)
    gen = torch.Generator().manual_seed(SEED)
    b, h, i, j = (int(torch.randint(n, (), generator=gen)) for n in Q.shape)
    print(f"Q of shape (B, H, N, d) = {tuple(Q.shape)}; reading x = {b}, y = {h}, z = {i}, b = {j}\n")

    # A float32 survives the round trip float -> Python float -> C++ float exactly: compare with ==.
    expected = Q[b][h][i][j].item()
    four = cs149gpt.fourDimRead(Q.flatten().tolist(), b, h, i, j, cfg.H, cfg.N, cfg.d)
    two = cs149gpt.twoDimRead(Q[b][h].flatten().tolist(), i, j, cfg.d)
    reads = [(f"Q[{b}][{h}][{i}][{j}]", expected),
             (f"fourDimRead(Q.flatten(), {b}, {h}, {i}, {j}, H, N, d)", four),
             (f"twoDimRead(Q[{b}][{h}].flatten(), {i}, {j}, d)", two)]
    width = max(len(name) for name, _ in reads)
    for name, value in reads:
        print(f"{name:<{width}}  {value:.6f}")
    print(f"\nfourDimRead == tensor indexing {four == expected}")
    print(f"twoDimRead == tensor indexing {two == expected}")
    return four == expected and two == expected


def print_summary(results: List[PartResult], cfg: Config) -> None:
    reference_ms = results[0].stats.median_ms
    flops = cfg.flops()
    header = ["part", "implementation", "time (ms)", "peak mem (MiB)", "GFLOP/s", "vs PyTorch", "check"]
    rows = [[r.part.name, r.implementation, f"{r.stats.median_ms:.3f}",
             "n/a" if r.stats.peak_bytes is None else mib(r.stats.peak_bytes),
             f"{flops / (r.stats.median_ms * 1e-3) / 1e9:.2f}", f"{reference_ms / r.stats.median_ms:.2f}x",
             "reference" if r.part.impl is None else ("pass" if r.passed else "FAIL")] for r in results]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    # Text columns to the left, numbers to the right.
    align = ["<", "<", ">", ">", ">", ">", "<"]

    def line(cells):
        return "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(cells, align, widths))

    print("\nSummary: " + shape_line(cfg))
    print(f"time: median of {results[0].stats.repeats} unprofiled calls; peak mem: the most held at once by "
          f"allocations through PyTorch's allocator;\nGFLOP/s: 4·B·H·d flops per (query, key) pair "
          f"({'N(N+1)/2 pairs, causal' if cfg.causal else 'N² pairs'}); vs PyTorch: part0's time over this time")
    print(line(header))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))


def shape_line(cfg: Config) -> str:
    return (f"B={cfg.B} H={cfg.H} N={cfg.N} d={cfg.d} float32, scale={cfg.scale:g}, causal={cfg.causal}, "
            f"threads={torch.get_num_threads()}, SIMD={cs149gpt.isa()}")


def run_part4_cuda(cfg: Config, dtype: torch.dtype, repeats: int) -> bool:
    """part4 on the GPU: cs149gpt.attention (csrc/cuda/) against PyTorch SDPA on the same device and inputs."""
    print(f"\nRunning Part 4 Test: Flash Attention on {torch.cuda.get_device_name()} ({str(dtype)[6:]})\n")
    Q, K, V = (t.to("cuda", dtype) for t in make_qkv(cfg))
    ref = torch.nn.functional.scaled_dot_product_attention(Q.float(), K.float(), V.float(), is_causal=cfg.causal,
                                                           scale=cfg.scale)
    ours = cs149gpt.attention(Q, K, V, scale=cfg.scale, is_causal=cfg.causal, block_q=cfg.br, block_k=cfg.bc)
    # float32 runs the teaching kernel in float32; bf16/f16 round P and the output to 16 bits.
    atol = ATOL if dtype == torch.float32 else (2e-2 if dtype == torch.bfloat16 else 2e-3)
    max_error = (ours.float() - ref).abs().max().item()
    passed = bool(max_error <= atol)
    print(f"manual attention == pytorch attention {passed} (max abs error {max_error:.3g}, atol {atol:g})")
    times = {}
    for name, fn in (("PyTorch SDPA", lambda: torch.nn.functional.scaled_dot_product_attention(
            Q, K, V, is_causal=cfg.causal, scale=cfg.scale)),
                     ("cs149gpt flash", lambda: cs149gpt.attention(Q, K, V, scale=cfg.scale, is_causal=cfg.causal,
                                                                   block_q=cfg.br, block_k=cfg.bc))):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(repeats):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        times[name] = statistics.median(samples)
        print(f"{name:<15} median of {repeats}: {times[name]:.3f} ms, "
              f"{cfg.flops() / (times[name] * 1e-3) / 1e12:.1f} TFLOP/s")
    return passed


# ---------------------------------------------------------------------------------------------------------
# --inference: a GPT that writes through the part's attention
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Generation:
    text: str
    prefill_s: float  # the prompt's forward, to the first sampled token
    decode_s: float  # the other tokens, one forward each against the KV cache
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.prefill_s + self.decode_s)

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 else float("nan")


def timed_generation(model, vocab, prompt: str, tokens: int, seed: int, stream: bool = False) -> Generation:
    """tokens characters after prompt, sampled with a generator seeded by seed; printed as they come if stream."""
    idx = torch.tensor([vocab.encode(prompt)], dtype=torch.long)  # (1, T)
    generator = torch.Generator().manual_seed(seed)
    pieces = []
    start = time.perf_counter()
    first = None
    for token in model.generate(idx, tokens, generator=generator):
        first = first or time.perf_counter()
        pieces.append(vocab.decode(token.tolist()))
        if stream:
            print(pieces[-1], end="", flush=True)
    end = time.perf_counter()
    return Generation("".join(pieces), prefill_s=first - start, decode_s=end - first, tokens=tokens)


def list_models(file=None) -> None:
    from cs149gpt.model import PRETRAINED

    file = file or sys.stdout
    print("models (-m NAME):", file=file)
    for name, entry in PRETRAINED.items():
        print(f"  {name:<11} context {entry.block_size:>4}: {entry.description}", file=file)


def run_inference(part: Part, model_name: str, prompt: str, tokens: int, seed: int, repeats: int) -> int:
    """Streams a sample written through part's attention, then times it against PyTorch SDPA in this run."""
    from cs149gpt.model import PRETRAINED, load_pretrained

    if model_name not in PRETRAINED:
        print(f"gpt149.py: no model {model_name!r}", file=sys.stderr)
        list_models(sys.stderr)
        return 2
    model, vocab = load_pretrained(model_name)
    vocab.encode(prompt)  # a character the model does not know: say so before anything else
    impl = part.impl or "sdpa"
    attention = "PyTorch SDPA" if part.impl is None else f"cs149gpt {part.impl}"
    print(f"Running inference using model {model_name}: {model.num_params() / 1e6:.2f}M parameters, "
          f"context {model.config.block_size} characters; attention: {part.name} ({attention}); seed {seed}; "
          f"threads={torch.get_num_threads()}\n")
    print("-" * 20)
    print(prompt, end="")
    ours = timed_generation(model.set_attention(impl), vocab, prompt, tokens, seed, stream=True)
    print("\n" + "-" * 20 + "\n")

    # Time both attentions on the same generation, interleaved so that a busy moment of the machine hits both.
    runs = {impl: [], "sdpa": []}
    for _ in range(repeats):
        for name in runs:
            runs[name].append(timed_generation(model.set_attention(name), vocab, prompt, tokens, seed))
    print(f"{tokens} tokens after a {len(prompt)}-character prompt, median of {repeats} generations "
          f"(prefill: the prompt's forward; decode: one token at a time against the KV cache)")
    rows = [(f"{part.name} {attention}", runs[impl])]
    if impl != "sdpa":
        rows.append(("part0 PyTorch SDPA", runs["sdpa"]))
    width = max(len(label) for label, _ in rows)
    print(f"{'attention':<{width}}  {'prefill ms':>10}  {'decode tokens/s':>15}  {'tokens/s':>9}")
    tokens_per_s = []
    for label, gens in rows:
        tokens_per_s.append(statistics.median(g.tokens_per_s for g in gens))
        print(f"{label:<{width}}  {statistics.median(g.prefill_s for g in gens) * 1e3:>10.2f}  "
              f"{statistics.median(g.decode_tokens_per_s for g in gens):>15.1f}  {tokens_per_s[-1]:>9.1f}")
    if impl != "sdpa":
        print(f"{part.impl} / SDPA: {tokens_per_s[0] / tokens_per_s[1]:.2f}x tokens/s")
        sdpa_text = runs["sdpa"][0].text
        same = next((i for i, (a, b) in enumerate(zip(ours.text, sdpa_text)) if a != b), None)
        print("the same seed with PyTorch SDPA writes " + ("the same text" if same is None else
              f"different text from character {same} on: a near-tie of the logits, which agree to float32 "
              f"rounding, fell on the other side of the sampled number"))
    return 0


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------
COMMANDS = [*PARTS, "4Daccess", "all"]


def int_at_least(minimum: int, what: str):
    """An argparse type: an integer >= minimum, else an error saying what was expected."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value}")
        return value

    return parse


positive_int = int_at_least(1, "positive")
non_negative_int = int_at_least(0, "non-negative")


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpt149.py",
        description="Check the cs149gpt attention kernels against PyTorch and profile both (CS149 assignment 4).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n"
               "  part0     the PyTorch reference alone, profiled\n"
               "  part1..4  naive, blocked, fused, flash: checked against PyTorch, both profiled\n"
               "  4Daccess  fourDimRead and twoDimRead against tensor indexing\n"
               "  all       part0..part4, then a summary table",
    )
    parser.add_argument("command", nargs="?", choices=COMMANDS, help="what to run (below)")
    parser.add_argument("-N", type=positive_int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("-d", type=positive_int, default=32, help="head dim (default 32)")
    parser.add_argument("-B", type=positive_int, default=1, help="batch size (default 1)")
    parser.add_argument("-H", type=positive_int, default=4, help="number of heads (default 4)")
    parser.add_argument("-br", type=positive_int, default=None,
                        help="part4: query rows per flash tile, Br (default: the kernel's)")
    parser.add_argument("-bc", type=positive_int, default=None,
                        help="part4: key rows per flash tile, Bc (default: the kernel's)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch.set_num_threads; the kernels obey it too (default: torch's, one per core)")
    parser.add_argument("--causal", action="store_true", help="mask key j from query i when j > i")
    parser.add_argument("--scale", type=finite_float, default=1.0,
                        help="multiplies Q·K before the softmax (default 1, the assignment's math)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="unprofiled calls after the profiled one, whose median time is reported (default 5)")
    parser.add_argument("--teaching", action="store_true",
                        help="part4: run the readable flash kernel (impl='flash_teaching') instead of the fast one")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="part4 only: where to run flash (default cpu; cuda needs a GPU and a CUDA build)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="--device cuda: the inputs' dtype (float32: the teaching kernel; default float32)")
    parser.add_argument("--inference", action="store_true",
                        help="generate text with a shipped GPT through the part's attention, streamed as it is "
                             "sampled, then compare its tokens/s with PyTorch SDPA")
    parser.add_argument("-m", "--model", default="shakes128",
                        help="--inference: the model, shakes128/256/1024/2048 by context length; -m list lists them "
                             "(default shakes128)")
    parser.add_argument("--prompt", default="\n", help="--inference: the text to continue (default a newline)")
    parser.add_argument("--tokens", type=positive_int, default=500,
                        help="--inference: characters to generate (default 500)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="--inference: seeds the sampling; the same seed and model write the same text (default 0)")
    return parser


def physical_memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.teaching and (args.command != "part4" or args.device != "cpu" or args.inference):
        parser.error("--teaching runs part4 on the CPU (the readable flash kernel beside PyTorch)")
    if args.inference:
        if args.model == "list":
            list_models()
            return 0
        if args.command not in PARTS:
            parser.error(f"--inference runs one part: choose one of {', '.join(PARTS)}")
        if not args.prompt:
            parser.error("--prompt: give at least one character to continue")
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        try:
            return run_inference(PARTS[args.command], args.model, args.prompt, args.tokens, args.seed, args.repeats)
        except (RuntimeError, ValueError) as e:  # a prompt character the model does not know, a failed build
            print(f"gpt149.py: error: {e}", file=sys.stderr)
            return 1
    if args.command is None:
        parser.error(f"choose what to run: {', '.join(COMMANDS)}")

    cfg = Config(B=args.B, H=args.H, N=args.N, d=args.d, scale=args.scale, causal=args.causal, br=args.br,
                 bc=args.bc)
    if args.dtype != "float32" and args.device != "cuda":
        parser.error("--dtype is for --device cuda (the CPU driver checks float32)")
    if args.device == "cuda":
        if args.command != "part4":
            parser.error("--device cuda runs part4 (flash) only: the other parts are CPU kernels")
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA GPU here")
        try:
            passed = run_part4_cuda(cfg, getattr(torch, args.dtype), args.repeats)
        except (RuntimeError, ValueError) as e:
            print(f"gpt149.py: error: {e}", file=sys.stderr)
            return 1
        return 0 if passed else 1
    if args.command != "4Daccess":
        # The reference holds B·H·N² scores and as many probabilities; refuse here rather than be OOM-killed.
        needed = 2 * cfg.B * cfg.H * cfg.N * cfg.N * 4
        available = physical_memory_bytes()
        if available is not None and needed > available:
            parser.error(f"-N {cfg.N}: the PyTorch reference needs {needed / 2**30:.1f} GiB for its B·H·N² scores "
                         f"and probabilities, more than this machine's {available / 2**30:.1f} GiB")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    try:
        print(f"cs149gpt driver: {shape_line(cfg)}, torch {torch.__version__}")
        if args.command == "4Daccess":
            return 0 if run_4d_access(cfg) else 1
        parts = list(PARTS.values()) if args.command == "all" else [PARTS[args.command]]
        if args.teaching:
            parts = [replace(PARTS["part4"], title="Flash Attention (teaching kernel)", impl="flash_teaching")]
        results = [run_part(part, cfg, args.repeats) for part in parts]
    except (RuntimeError, ValueError) as e:
        # Out of memory, a failed build, or a kernel's argument check: the message names the cause and the
        # traceback would only show the driver. Anything else is a bug here and keeps its traceback.
        print(f"gpt149.py: error: {e}", file=sys.stderr)
        return 1
    if args.command == "all":
        print_summary(results, cfg)
    failed = [r.part.name for r in results if not r.passed]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}: output differs from the PyTorch reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
