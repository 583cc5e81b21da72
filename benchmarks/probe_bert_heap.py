#!/usr/bin/env python3
"""Which of glibc's heap settings the page faults of a BERT forward depend on, ours against torch's SDPA (issue 11:
BERT 32 x 128 float32 on 16 threads faulted 40,678 times a forward with ours, 16,352 with SDPA, and ran at 0.84x;
with MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ set, neither faulted: results/s9j_bert_malloc.txt).
One attention per process (the process's heap history is the point), median forward time, faults a forward, and
glibc's mallinfo2 after the last forward: sbrk'd heap (arena), mmapped chunks (hblkhd), trimmable top (keepcost).

    for env in "" MALLOC_ARENA_MAX=1 ...; do env $env python benchmarks/probe_bert_heap.py sdpa 16; done

PROBE_SPACER_MB=2 (with cs149gpt): each of our attention calls first allocates and writes that many MiB of float32,
kept until the call returns — what SDPA's path does when it turns the bool mask into a float one (torch.where,
(32, 1, 128, 128): 2 MiB) — to see whether the heap's pattern of faults follows that allocation.
"""
import ctypes
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cs149gpt  # noqa: E402


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def main() -> int:
    impl, threads = sys.argv[1], int(sys.argv[2])
    dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
    import transformers
    cs149gpt.register_transformers()
    spacer_mb = float(os.environ.get("PROBE_SPACER_MB", "0"))
    if impl == "cs149gpt" and spacer_mb > 0:
        from cs149gpt import integration

        def with_spacer(*args, **kwargs):
            spacer = torch.ones(int(spacer_mb * 2**18))  # float32, every page written
            out = integration._transformers_attention(*args, **kwargs)
            del spacer
            return out
        transformers.AttentionInterface.register("cs149gpt", with_spacer)
    torch.set_num_threads(threads)
    config = transformers.BertConfig(vocab_size=1000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                     intermediate_size=1024, max_position_embeddings=4096, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation=impl).to(dtype).eval()
    B, N = 32, 128
    ids = torch.randint(1, 1000, (B, N))
    mask = torch.ones(B, N, dtype=torch.long)
    for i in range(B):
        mask[i, N - (i * N) // (2 * B):] = 0
    times, faults = [], []
    with torch.no_grad():
        for r in range(12):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=mask)
            if r >= 2:
                times.append(time.perf_counter() - start)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    m = libc.mallinfo2()
    env = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith(("MALLOC_", "PROBE_"))) or "default"
    print(f"| {env} | {impl} | {threads} | {str(dtype)[6:]} | {statistics.median(times) * 1e3:.2f} | "
          f"{statistics.median(faults):.0f} | {m.arena / 2**20:.0f} | {m.hblkhd / 2**20:.0f} | {m.keepcost / 2**20:.1f} |",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
