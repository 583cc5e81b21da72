// Every tile default and path choice of the CPU kernels, each with the finding that set it.
//
// The kernels' algorithms take these as given; changing one changes speed only, never the result's correctness
// (tests run the kernels at other tiles and paths too). Two parts: choices the same on every instruction set
// (namespace heuristics: module.cpp and the kernels read them), and tile sizes per instruction set (namespace
// <isa>::tiles: only the kernels, compiled once per ISA in csrc/isa/, read them; that part is compiled where
// CS149_ISA is defined). Machines: "16-core Xeon" is a 16-core Xeon (Emerald Rapids) with AMX; "2-core EPYC" an
// AMD EPYC with AVX-512 on 2 cores. "×SDPA" is a speed relative to torch's scaled_dot_product_attention.
#ifndef CS149GPT_HEURISTICS_H
#define CS149GPT_HEURISTICS_H

#include <algorithm>
#include <cstdint>
#include <numeric>

#include "attention.h"

namespace cs149gpt {
namespace heuristics {

// blocked (part 2): one tile for both matrix multiplies. 32 and 64 level on a 2-core EPYC, ahead of 16, 128 and 256.
constexpr int64_t kBlockedTile = 64;
// flash_teaching, the readable part 4, and its CUDA twin (cuda/flash_api.cpp): Br x Bc, for reading, not tuned.
constexpr int64_t kTeachingBlockQ = 64, kTeachingBlockK = 32;

// ---- flash-decoding (flash_decode.cpp) ----
// attention() calls with at most this many query rows (the tokens being generated against a cache), attn_mask and
// window included and tiles left to the kernel, go to flash-decoding, which splits the keys instead of the queries.
// Dropout stays on the tiled kernels (inference never uses it), and so do packed sequences (a task per sequence's tile).
constexpr int64_t kDecodeMaxRows = 16;
inline bool decode_kernel_takes(const AttentionParams& p) {
  return p.q_len <= kDecodeMaxRows && p.block_q <= 0 && p.block_k <= 0 && p.dropout_p == 0.0f && !p.cu_seqlens_q;
}
// Split a row's keys until there are tasks for this many threads, no split shorter than kDecodeMinSplitKeys (~5 µs
// of work for a GQA group of 4 at d = 128, against a task's fixed cost of a few tenths of a µs).
constexpr int64_t kDecodeMinTasks = 64;
constexpr int64_t kDecodeMinSplitKeys = 256;
// Below this many bytes of K and V (and multiply-adds), a call runs on the calling thread alone: inside a GPT at
// context 1024 on a 16-core Xeon, a 1 MB call took 55 µs on one thread and 16 µs on 16 (the pool is awake between
// operators); 2^20 multiply-adds took 28 µs on one thread against SDPA's 23–25 on 16.
constexpr int64_t kDecodeSerialBytes = 256 * 1024;
constexpr int64_t kDecodeParallelMacs = 512 * 1024;

// ---- the merge of two partial results (merge.cpp, ring attention) ----
// A thread for each this many elements of out, at most the caller's threads: on a 2-core EPYC 2^16 elements took 17 µs on
// one thread and 19 on two, 2^18 took 56 and 34.
constexpr int64_t kMergeElementsPerThread = 1 << 16;

// ---- attn_mask's runs of keys (mask_ranges.cpp) ----
// A mask with a bias inside its runs is scanned only where each row serves this many (batch, head) pairs: a causal
// ALiBi bias (1, 12, 1024, 1024) over a batch of 4 ran 1.1–1.5× faster scanned on a 16-core Xeon, while a bias read
// once a row ran 1.3–1.7× slower (the scan reads every row once more).
constexpr int64_t kMinBiasReuse = 4;

// ---- the backward's algorithm (flash_backward_onepass.cpp, flash_backward_bf16.cpp or flash_backward.cpp) ----
// One pass (five tile products, a task per (batch, kv head) owning its gradient rows, split into key_chunks runs of
// key tiles and, float32, head_parts parts of its query heads when there are too few for the CPUs) when its tasks
// keep enough of this machine's CPUs busy; two passes (seven products, tasks per tile) otherwise. Decided from the
// shape and the machine's CPU count, never the call's thread count, so that the gradients' bits do not depend on it.
// The one-pass kernel runs ~1.6× the two-pass one's speed per thread: worth it from 60 % of the CPUs busy.
constexpr double kOnePassMinBusy = 0.6;
// bf16 on dot-product hardware (the one pass multiplies on it, the two passes convert to float32): Gemma-2B's heads
// (8 query, 1 kv, d = 256, 1024 keys) keep half of a 16-core Xeon busy, and one pass ran 1.45×SDPA on one thread
// where two ran 0.26×. So from a quarter of the CPUs.
constexpr double kOnePassMinBusyBf16Dot = 0.25;
constexpr double kKeyChunksBusy = 0.85;  // bf16: split a kv head's keys until this many of the CPUs are busy
constexpr int64_t kMaxKeyChunks = 8, kMinKeysPerChunk = 128;
// float32 splits until this many tasks a CPU (its runs' dQ merge as they end, so runs cost no memory): on a 16-core
// Xeon (1,16,4096,128) ran 1.13×SDPA with 16 tasks and 1.29–1.32× with 64; (4,12,2048,64) 1.51× with 48, 1.6× with 96.
constexpr int64_t kTasksPerCpu = 4;

// The share of `cpus` that `tasks` equal tasks keep busy over the rounds they take.
inline double busy_share(int64_t tasks, int64_t cpus) {
  const int64_t rounds = (tasks + cpus - 1) / cpus;
  return static_cast<double>(tasks) / static_cast<double>(rounds * cpus);
}

// Forced choices (tests run every path): path -1 decides by shape, 0 two passes, 1 one pass; 0 chunks or parts
// decide by shape.
struct BackwardForce {
  int path = -1;
  int64_t key_chunks = 0, head_parts = 0;
};

// Sets bp.path, bp.key_chunks and bp.head_parts for a machine of `cpus` CPUs; bf16_dot: the ISA has bf16
// dot-product hardware.
inline void choose_backward(AttentionBackwardParams& bp, int64_t cpus, bool bf16_dot, const BackwardForce& force) {
  const AttentionParams& p = bp.fwd;
  // Packed sequences: a task per (sequence, kv head) on the one-pass kernels (per (sequence, tile) on the two-pass one,
  // which softcap and ALiBi need), each reading its sequence as a call of its own (sequence_view); key runs and head
  // parts, whose tasks share sums, stay whole.
  if (p.cu_seqlens_q) {
    bp.path = has_logit_mods(p) ? BackwardPath::two_pass : BackwardPath::one_pass;
    bp.key_chunks = bp.head_parts = 1;
    return;
  }
  const int64_t pairs = p.batch * p.num_kv_heads;
  const int64_t most_chunks = std::clamp<int64_t>(p.kv_len / kMinKeysPerChunk, 1, kMaxKeyChunks);
  int64_t chunks = 1;
  if (p.dtype == DType::f32) {
    while (chunks * 2 <= most_chunks && pairs * chunks < kTasksPerCpu * cpus) chunks *= 2;
  } else {
    while (chunks * 2 <= most_chunks && busy_share(pairs * chunks, cpus) < kKeyChunksBusy) chunks *= 2;
  }
  if (force.key_chunks > 0) chunks = force.key_chunks;
  bp.key_chunks = chunks;
  // float32, still too few tasks: the group's query heads in parts too (halving while the group divides). Gemma-2B's
  // 8 query heads on 1 kv head, 1024 keys: 8 runs × 8 parts, where 8 runs alone took two passes at 0.77×SDPA.
  int64_t parts = 1;
  if (p.dtype == DType::f32) {
    const int64_t group = p.num_heads / p.num_kv_heads;
    while (group % (parts * 2) == 0 && pairs * chunks * parts < kTasksPerCpu * cpus) parts *= 2;
  }
  if (force.head_parts > 0) parts = force.head_parts;
  bp.head_parts = parts;
  const int64_t tasks = pairs * chunks * (p.dtype == DType::f32 ? std::gcd(parts, p.num_heads / p.num_kv_heads) : 1);
  const bool bf16_on_dot = p.dtype == DType::bf16 && bf16_dot;
  if (has_logit_mods(p))  // softcap and ALiBi: the two-pass kernel (flash_backward.cpp) only
    bp.path = BackwardPath::two_pass;
  else if (force.path >= 0)
    bp.path = force.path == 1 ? BackwardPath::one_pass : BackwardPath::two_pass;
  else
    bp.path = busy_share(tasks, cpus) >= (bf16_on_dot ? kOnePassMinBusyBf16Dot : kOnePassMinBusy)
                  ? BackwardPath::one_pass : BackwardPath::two_pass;
}

}  // namespace heuristics
}  // namespace cs149gpt

#endif  // CS149GPT_HEURISTICS_H

// ---- tile sizes per instruction set: the kernels' translation units only (csrc/isa/) ----
#if defined(CS149_ISA) && !defined(CS149GPT_HEURISTICS_TILES_H)
#define CS149GPT_HEURISTICS_TILES_H
namespace cs149gpt {
namespace CS149_ISA {
namespace tiles {

// float32 flash forward (flash.cpp), in row groups (flash_common.h: 24 rows with AVX-512, 12 otherwise) × keys.
#if defined(CS149_ISA_AVX512)
// 512 keys: 8–15 % faster than 128 on one thread of a 16-core Xeon at d = 64 and 128.
constexpr int64_t kFlashRowGroups = 4, kFlashBlockK = 512;
// No causal mask or window: 8 groups × 1024 keys (K_j, V_j reused from L2, O_i rescaled once a tile) ran 0.97–1.12×
// (median 1.05×) the speed of 4 × 512 on 1 and 16 threads; causal keeps 4 × 512 (1024 keys: 2.15 → 1.84×SDPA on 16
// threads, its tasks of unequal cost).
constexpr int64_t kFlashWideRowGroups = 8, kFlashWideBlockK = 1024;
#else
// AVX2, scalar: 64–512 keys within ~10 % of each other on a 2-core EPYC.
constexpr int64_t kFlashRowGroups = 4, kFlashBlockK = 128;
constexpr int64_t kFlashWideRowGroups = kFlashRowGroups, kFlashWideBlockK = kFlashBlockK;
#endif

// bf16 / float16 flash forward on dot-product hardware (flash_bf16.cpp), rows × keys (fewer rows when the threads
// need more tasks).
#if defined(CS149_ISA_AMX)
// AMX: 256 × 1024 ran 1.02–1.26× the GFLOP/s of 128 × 512 in 13 of 16 (shape, threads, causal) cells on a 16-core Xeon.
constexpr int64_t kBf16BlockQ = 256, kBf16BlockK = 1024;
#else
constexpr int64_t kBf16BlockQ = 128, kBf16BlockK = 128;  // vdpbf16ps: 4 groups of 32 rows × 128 keys
#endif

// float32 two-pass backward (flash_backward.cpp): query and key tiles of 4 row groups each.
constexpr int64_t kBackwardRowGroups = 4;

// float32 one-pass backward (flash_backward_onepass.cpp): 4 row groups (96 rows with AVX-512) × keys by head_dim.
constexpr int64_t kOnePassRowGroups = 4;
// On 16 threads of a 16-core Xeon: d ≤ 64 with AVX-512, 192 keys (4,12,2048,64) 1.64×SDPA against 1.47 with 96;
// d > 64, 96 keys (1,16,4096,128) 1.22× ahead of 192's 1.18; d ≤ 32, 96 keys 3.41× against 3.03. AVX2: 96, unmeasured.
inline int64_t one_pass_block_k(int64_t head_dim) {
#if defined(CS149_ISA_AVX512)
  if (head_dim > 32 && head_dim <= 64) return 192;
#endif
  (void)head_dim;
  return 96;
}

// bf16 / float16 one-pass backward (flash_backward_bf16.cpp): 128 query rows for d ≤ 64 (the best of 32–128 on a
// 2-core EPYC), 64 above (less scratch per thread).
inline int64_t bf16_backward_block_q(int64_t head_dim) { return head_dim > 64 ? 64 : 128; }
#if defined(CS149_ISA_AMX)
// AMX: 256 keys, (1,16,4096,128) on 16 threads of a 16-core Xeon 1.57×SDPA against 1.14 with 128 keys (causal 1.54
// against 1.38); d ≤ 64 0.97–1.49× the speed of 128 keys. Scores in 32-key strips keep peak memory under SDPA's.
constexpr int64_t kBf16BackwardBlockK = 256;
#else
constexpr int64_t kBf16BackwardBlockK = 128;  // vdpbf16ps: 256 keys within noise of 128 on a 2-core EPYC
#endif

// flash-decoding's keys (decode_micro.h): by vdpbf16ps, or by FMAs on keys converted to float32. On a 16-core Xeon
// vdpbf16ps runs at a quarter of the FMA's rate (82 against 154 GFLOP/s a thread), and its keys were slower at 19 of
// 20 bf16 shapes (by up to 26 %): AMX CPUs take the FMAs, other bf16 dot-product CPUs (AMD Zen 4/5) vdpbf16ps.
#if defined(CS149_ISA_BF16_DOT) && !defined(CS149_ISA_AMX)
constexpr bool kDecodeKeysByBf16Dot = true;
#else
constexpr bool kDecodeKeysByBf16Dot = false;
#endif

}  // namespace tiles
}  // namespace CS149_ISA
}  // namespace cs149gpt
#endif  // CS149_ISA
