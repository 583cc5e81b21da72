#!/usr/bin/env python3
"""Per-kernel instruction counts of the built CUDA objects (cuobjdump -sass), and where the local-memory spills are.

    python benchmarks/sass_summary.py build/jit-*-cuda/flash_fwd_hdim128_bf16.cuda.o [--spills REGEX]

For each kernel: how many HMMA, LDSM, LDS/STS, LDL/STL, MUFU, BAR ... the compiler emitted (static counts, not
executed ones). --spills: for the kernels whose name matches, every LDL/STL with the instructions around it.
"""
import argparse
import collections
import re
import subprocess

ap = argparse.ArgumentParser()
ap.add_argument("objects", nargs="+")
ap.add_argument("--spills", default=None, help="regex of kernel names whose spill sites to print")
args = ap.parse_args()
WATCH = ["HMMA", "LDSM", "LDS", "STS", "LDGSTS", "LDL", "STL", "MUFU", "BAR", "SHFL", "RED", "FFMA", "FMUL", "FADD",
         "FMNMX", "F2FP", "IMAD", "IADD3", "LEA", "ISETP", "BRA"]
for obj in args.objects:
    sass = subprocess.run(["cuobjdump", "-sass", obj], capture_output=True, text=True).stdout
    for block in sass.split("Function : ")[1:]:
        name, body = block.split("\n", 1)
        ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)(?:\.[\w.]+)?\s", body)
        counts = collections.Counter(ins)
        short = re.sub(r"cs149gpt::|cuda::|__nv_bfloat16|AttentionParams|AttentionBackwardParams", "", name)
        print(f"{short[:230]}\n  total {len(ins)}: " + " ".join(f"{k} {counts[k]}" for k in WATCH if counts[k]))
        if args.spills and re.search(args.spills, name) and (counts["LDL"] or counts["STL"]):
            lines = body.splitlines()
            for i, line in enumerate(lines):
                if re.search(r"\b(LDL|STL)\b", line):
                    print("   ---")
                    for ctx in lines[max(0, i - 3):i + 2]:
                        print("   ", ctx.strip()[:110])
