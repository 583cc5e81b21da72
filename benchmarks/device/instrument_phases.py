#!/usr/bin/env python3
"""Adds phase timers to a copy of the tree's forward (device measurement only; never on the committed code).

    python benchmarks/device/instrument_phases.py .gpu_stage/phase     # edits .gpu_stage/phase/csrc/kernels/flash_common.h

run_forward_tiles (flash_common.h) gets wall-clock marks around its phases — the fork of the threads, the packing
to its barrier (with the last thread's arrival and each thread's own packing time), each thread's busy time over
the query tiles, the join — summed over the process's calls and
printed at exit (stderr, a line starting PHASES); benchmarks/device/phase_times.py drives it. The pack loop's own
line is kept as the tree has it, so the same edit applies to the base tree and to the new one. A tree with
session 18's schedule (no barrier: packing chunks and query tiles in one loop) gets instead each thread's time in
packing, in tiles and waiting for a kv head's chunks (a line starting JOBS).
"""
import re
import sys
from pathlib import Path

path = Path(sys.argv[1]) / "csrc/kernels/flash_common.h"
s = path.read_text()
if "wait_for_count(" in s:
    # Session 18's schedule (one dynamic loop of packing chunks and query tiles, no barrier): each thread's time in
    # packing, in tiles and spinning for a kv head's chunks, the busiest thread's total, and the region.
    header = """#include <omp.h>
#include <cstdio>

struct JobTimes {  // instrument_phases.py: per-call means, printed at exit
  double calls = 0, pack = 0, tile = 0, spin = 0, busy_max = 0, region = 0;
  ~JobTimes() {
    if (calls == 0) return;
    const double us = 1e6 / calls;
    std::fprintf(stderr, "JOBS calls %.0f | a thread's mean: packing %.1f us, tiles %.1f us, waiting for chunks %.1f us"
                 " | busiest thread %.1f us | region %.1f us\\n", calls, pack * us, tile * us, spin * us,
                 busy_max * us, region * us);
  }
};
inline thread_local double tl_pack = 0, tl_tile = 0, tl_spin = 0;
"""
    reps = [
        ("    if (packs > 0) wait_for_count(ready + (b * p.num_kv_heads + kv_head(p, h)) * kCounterStride, packs);",
         "    const double w0 = omp_get_wtime();\n"
         "    if (packs > 0) wait_for_count(ready + (b * p.num_kv_heads + kv_head(p, h)) * kCounterStride, packs);\n"
         "    tl_spin += omp_get_wtime() - w0;"),
        ("    tile(b, h, i * Br, scratch);\n  };",
         "    const double t0 = omp_get_wtime();\n    tile(b, h, i * Br, scratch);\n    tl_tile += omp_get_wtime() - t0;\n  };"),
        ("    pack(kv / p.num_kv_heads, kv % p.num_kv_heads, u);",
         "    const double t0 = omp_get_wtime();\n    pack(kv / p.num_kv_heads, kv % p.num_kv_heads, u);\n"
         "    tl_pack += omp_get_wtime() - t0;"),
        ("  const int64_t n_jobs = kv_heads * packs + n_tasks;\n#pragma omp parallel num_threads(p.num_threads)\n  {",
         "  const int64_t n_jobs = kv_heads * packs + n_tasks;\n  const double t_enter = omp_get_wtime();\n"
         "  double pack_sum = 0, tile_sum = 0, spin_sum = 0, busy_max = 0;\n"
         "#pragma omp parallel num_threads(p.num_threads)\n  {\n    tl_pack = tl_tile = tl_spin = 0;"),
        ("        run_task(k * unit_tasks + r - chunks_before, scratch);\n    }\n  }\n}",
         "        run_task(k * unit_tasks + r - chunks_before, scratch);\n    }\n"
         "#pragma omp critical\n    {\n      pack_sum += tl_pack, tile_sum += tl_tile, spin_sum += tl_spin;\n"
         "      busy_max = std::max(busy_max, tl_pack + tl_tile + tl_spin);\n    }\n  }\n"
         "  static JobTimes totals;\n  const double n = p.num_threads;\n  totals.calls += 1;\n"
         "  totals.pack += pack_sum / n, totals.tile += tile_sum / n, totals.spin += spin_sum / n;\n"
         "  totals.busy_max += busy_max, totals.region += omp_get_wtime() - t_enter;\n}"),
    ]
    for a, b in reps:
        assert a in s, a
        s = s.replace(a, b)
    s = s.replace("#include <omp.h>\n", header, 1)
    path.write_text(s)
    print("instrumented (jobs)", path)
    sys.exit(0)
pragma, loop = re.search(r"^#pragma omp for schedule\([^)]*\)\n *for \(int64_t t = 0; t < n_pack; \+\+t\) pack\(.*\);$",
                         s, re.M).group(0).split("\n", 1)
pack_loop = pragma + " nowait\n" + loop  # the tree's own schedule; the barrier comes after the thread's timing
start = s.index("#pragma omp parallel num_threads(p.num_threads)\n  {\n#pragma omp for schedule(")
end = s.index("// The end of a query tile")
timed = '''  const double t_enter = omp_get_wtime();
  double t_fork = 0, t_packed = 0, busy_sum = 0, busy_max = 0, last_end = 0, arrive_max = 0, work_sum = 0, work_max = 0;
#pragma omp parallel num_threads(p.num_threads)
  {
#pragma omp master
    t_fork = omp_get_wtime();
    const double t_arrive = omp_get_wtime();
PACK_LOOP
    const double t_pack_done = omp_get_wtime();
#pragma omp barrier
#pragma omp master
    t_packed = omp_get_wtime();
    const double t_start = omp_get_wtime();
    float* scratch = thread_scratch + omp_get_thread_num() * per_thread;
    {
      const PerThread setup;
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t task = 0; task < n_tasks; ++task) {
        int64_t b, h, i;
        if (batch_inner) {
          b = task % p.batch, i = Tr - 1 - (task / p.batch) % Tr, h = task / (p.batch * Tr);
        } else {
          i = Tr - 1 - task % Tr, h = (task / Tr) % p.num_heads, b = task / (Tr * p.num_heads);
        }
        tile(b, h, i * Br, scratch);
      }
    }
    const double t_end = omp_get_wtime();
#pragma omp critical
    {
      busy_sum += t_end - t_start;
      arrive_max = std::max(arrive_max, t_arrive - t_fork);
      work_sum += t_pack_done - t_arrive;
      work_max = std::max(work_max, t_pack_done - t_arrive);
      busy_max = std::max(busy_max, t_end - t_start);
      last_end = std::max(last_end, t_end);
    }
  }
  const double t_join = omp_get_wtime();
  static PhaseTimes totals;
  totals.calls += 1;
  totals.enter_to_fork += t_fork - t_enter;
  totals.pack += t_packed - t_fork;
  totals.arrive_max += arrive_max;
  totals.pack_work_mean += work_sum / p.num_threads;
  totals.pack_work_max += work_max;
  totals.tiles_mean_busy += busy_sum / p.num_threads;
  totals.tiles_max_busy += busy_max;
  totals.last_to_join += t_join - last_end;
  totals.total += t_join - t_enter;
}

'''.replace("PACK_LOOP", pack_loop)
header = '''#include <omp.h>
#include <cstdio>

struct PhaseTimes {  // instrument_phases.py: per-call means, printed at exit
  double calls = 0, enter_to_fork = 0, pack = 0, tiles_mean_busy = 0, tiles_max_busy = 0, last_to_join = 0, total = 0;
  double arrive_max = 0, pack_work_mean = 0, pack_work_max = 0;
  ~PhaseTimes() {
    if (calls == 0) return;
    const double us = 1e6 / calls;
    std::fprintf(stderr, "PHASES calls %.0f | fork %.1f us | pack %.1f us (last thread in %.1f us; a thread's packing"
                 " mean %.1f, max %.1f) | tiles: mean thread busy %.1f us, max %.1f us | last tile to join %.1f us |"
                 " region %.1f us\\n", calls, enter_to_fork * us, pack * us, arrive_max * us, pack_work_mean * us,
                 pack_work_max * us, tiles_mean_busy * us, tiles_max_busy * us, last_to_join * us, total * us);
  }
};
'''
s = s[:start] + timed + s[end:]
s = s.replace("#include <omp.h>\n", header, 1)
path.write_text(s)
print("instrumented", path)
