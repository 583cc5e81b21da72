#!/usr/bin/env python3
"""Writes text with a shipped model (or any checkpoint of train.py) through the attention of your choice.

    python cs149gpt/sample.py                                   the knobs below
    python cs149gpt/sample.py --model=shakes2048 --prompt="KING LEAR:" --max_new_tokens=1000 --temperature=0.8

The driver (gpt149.py partN --inference) does the same and times it against PyTorch; this is the short way in.
"""
import ast
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from cs149gpt.model import PRETRAINED, load_checkpoint, load_pretrained  # noqa: E402

model = "shakes1024"  # a name of PRETRAINED (shakes128/256/1024/2048), or the path of a checkpoint
attention = "flash"  # "sdpa" (PyTorch), or cs149gpt's "naive", "blocked", "fused", "flash"
prompt = "\n"
max_new_tokens = 500
temperature = 1.0  # < 1: more conservative, > 1: more surprising; 0: always the likeliest character
top_k = None  # sample only among the k likeliest characters
seed = 1337
threads = 1  # a one-token step is ~100 small ops: a second thread mostly adds OpenMP barriers

KNOBS = ("model", "attention", "prompt", "max_new_tokens", "temperature", "top_k", "seed", "threads")

if __name__ == "__main__":
    for arg in sys.argv[1:]:  # --knob=value, as nanoGPT's configurator
        key, _, value = arg.removeprefix("--").partition("=")
        if key not in KNOBS:
            raise SystemExit(f"sample.py: no knob {key!r}; the knobs are --{', --'.join(KNOBS)}")
        globals()[key] = value if isinstance(globals()[key], str) else ast.literal_eval(value)
    torch.set_num_threads(threads)
    gpt, vocab = load_pretrained(model) if model in PRETRAINED else load_checkpoint(model)[:2]
    gpt.set_attention(attention)
    idx = torch.tensor([vocab.encode(prompt)])  # (1, T)
    print(prompt, end="")
    for token in gpt.generate(idx, max_new_tokens, temperature, top_k, torch.Generator().manual_seed(seed)):
        print(vocab.decode(token.tolist()), end="", flush=True)
    print()
