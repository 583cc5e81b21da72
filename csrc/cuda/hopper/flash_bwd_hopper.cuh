// FlashAttention-3's backward on Hopper: the loop of flash_bwd.cuh (the paper's Algorithm 2), warp-specialized.
//
//   D_i = rowsum(dO_i ∘ O_i), lse_i·log2(e)                      (flash_bwd_delta_kernel, flash_bwd.cuh: one workspace)
//   one block per key tile j (128 keys; dK_j, dV_j in the consumers' registers for the whole block):
//   producer warpgroup (one thread):   K_j, V_j once;  for each (query head, query tile i) that sees these keys: wait
//                                      until stage i % 2 is empty, then TMA Q_i + lse_i, and dO_i + D_i into it
//   consumer warpgroup w (keys 64w .. 64w + 63 of the tile, w = 0, 1):
//     for each query tile i:  Sᵀ = K_w Q_iᵀ;  dPᵀ = V_w dO_iᵀ                        (wgmma, both from shared memory)
//                             Pᵀ = exp2(scale·log2e · Sᵀ − lse_i·log2e);  dSᵀ = Pᵀ ∘ (dPᵀ − D_i)   (keys x queries)
//                             dV_w += Pᵀ dO_i                                   (wgmma, Pᵀ from registers)
//                             dSᵀ -> shared memory;  both warpgroups' halves written (a named barrier)
//                             dQ_i += dS K_j   (one 64 x 64 block of dQ_i per warpgroup, float32 reductions to dq_accum:
//                                               from registers, or with kDqTma two bulk tensor reductions from shared memory)
//                             dK_w += dSᵀ Q_i                                   (wgmma, dSᵀ from registers)
//                             hand the stage back to the producer
//     dK_w·scale, dV_w -> dk, dv
//
// Keys are wgmma's M: the accumulators of Sᵀ and dPᵀ hold key rows, and converted to 16 bits they are, register for
// register, the A operands of dV += Pᵀ dO and dK += dSᵀ Q (ptx.cuh), as P is of P V in the forward. Masked entries
// (keys past kv_len, query rows past q_len, the causal mask) are 0 in Pᵀ and dSᵀ. The contract (workspace, dq_accum,
// scaling, GQA) is flash_bwd's (flash_cuda.h).
//
// Packed sequences (cu_seqlens): a block per (key tile of the longest sequence, head, sequence), reading its sequence's
// rows of the packed tensors (packed.cuh). A tile that runs past its sequence's end holds the next sequence's rows
// (only the tensor's end reads as zeros): their entries of Pᵀ and dSᵀ are masked, but 0 · inf is NaN, so the consumers
// zero those rows of K (once) and of Q and dO (in the step of a sequence's last query tile) before a product reads
// them, and drop dQ's rows past the sequence: no sequence's gradients see another's values.
//
// Key spans (a boolean attn_mask, windows, with or without the causal mask; dense calls): the forward's
// (flash_fwd_hopper.cuh) in the other direction. Before the kernel, a table gives each 64-row query tile the keys
// [first, end) some row of it sees and the keys [full_lo, full_hi) every row of it sees exactly (flash_cuda.h,
// bwd_span_tiles). A block's producer warp reads the table 32 query tiles at a time and visits only the tiles whose
// [first, end) meets the block's keys. For a tile not inside [full_lo, full_hi) it also writes, for each query row,
// which of the block's 128 keys the row sees (in its span, and where the row is not exact, a true attn_mask entry) as
// 128 bits in shared memory. It hands each step's (query head, query tile, whether it needs the mask) to the consumers
// with the step's Q, and ends the block with a step marked empty. On such a tile the consumers set Pᵀ (so dSᵀ) to 0
// where a bit is clear: they test bits and never read attn_mask (whose reads in the consumers cost 70-200 bytes of
// spilled registers in the main loop).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "../../attention.h"
#include "../flash_bwd.cuh"
#include "../flash_common.cuh"
#include "flash_bwd_hopper_launch.h"
#include "kernel_traits.cuh"
#include "packed.cuh"
#include "ptx.cuh"
#include "tensor_map.h"

namespace cs149gpt {
namespace cuda {
namespace hopper {

// The block's shared memory (BwdTraits' layout), from a 1024-byte aligned base.
template <class Traits>
struct BwdSharedTiles {
  char* k;       // kPanels panels of kBlockN keys x 128 bytes
  char* v;       // the same
  char* q;       // [kStages] tiles of kPanels panels of kBlockM rows x 128 bytes
  char* dout;    // the same
  char* ds;      // [2] dSᵀ tiles: kBlockM / 64 panels of kBlockN keys x 64 queries
  char* dq;      // kDqTma: [kConsumerWarpgroups] dQ blocks, two boxes of 64 rows x 32 float32 columns
  float* lse2;   // [kStages][kBlockM] lse·log2e of the stage's query rows
  float* delta;  // [kStages][kBlockM] D
  uint64_t* kv_full;   // K and V have arrived
  uint64_t* q_full;    // [kStages]: Q and lse2 of the stage have arrived
  uint64_t* do_full;   // [kStages]: dO and D of the stage have arrived
  uint64_t* q_empty;   // [kStages]: every consumer warp is done with the stage's Q (and lse2)
  uint64_t* do_empty;  // [kStages]: every consumer warp is done with the stage's dO (and D)
  int4* steps;         // key spans: [kStages] the stage's step (BwdStep)
  uint32_t* row_bits;  // key spans: [kStages][kBlockM][4] which of the tile's 128 keys each query row sees

  __device__ explicit BwdSharedTiles(char* base)
      : k(base + Traits::kSmemK),
        v(base + Traits::kSmemV),
        q(base + Traits::kSmemQ),
        dout(base + Traits::kSmemDo),
        ds(base + Traits::kSmemDs),
        dq(base + Traits::kSmemDq),
        lse2(reinterpret_cast<float*>(base + Traits::kSmemLse)),
        delta(reinterpret_cast<float*>(base + Traits::kSmemDelta)),
        kv_full(reinterpret_cast<uint64_t*>(base + Traits::kSmemBarriers)),
        q_full(kv_full + 1),
        do_full(q_full + Traits::kStages),
        q_empty(do_full + Traits::kStages),
        do_empty(q_empty + Traits::kStages),
        steps(reinterpret_cast<int4*>(base + Traits::kSmemSteps)),
        row_bits(reinterpret_cast<uint32_t*>(base + Traits::kSmemRowBits)) {}
  __device__ char* q_tile(int stage) const { return q + stage * Traits::kQBytes; }
  __device__ char* do_tile(int stage) const { return dout + stage * Traits::kQBytes; }
  __device__ char* ds_tile(int step) const { return ds + (step % 2) * Traits::kDsBytes; }
  __device__ char* dq_block(int wg) const { return dq + wg * Traits::kDqBytes; }
  __device__ float* lse2_rows(int stage) const { return lse2 + stage * Traits::kBlockM; }
  __device__ float* delta_rows(int stage) const { return delta + stage * Traits::kBlockM; }
  __device__ uint32_t* bits_of(int stage) const { return row_bits + stage * Traits::kBlockM * 4; }
};

// Key spans: a step as the producer hands it to the consumers (an int4 in shared memory). valid = false ends the
// block. first_key_tile: the first key tile any row of the query tile sees (the key tiles that see it are that one and
// the next ones, each visiting it: the deterministic dQ order counts from it).
struct BwdStep {
  int h, m_tile;
  bool needs_mask, valid;
  int first_key_tile;
  __device__ static BwdStep from(int4 x) { return {x.x, x.y, (x.z & 1) != 0, (x.z & 2) != 0, x.w}; }
  __device__ int4 packed() const {
    return make_int4(h, m_tile, (needs_mask ? 1 : 0) | (valid ? 2 : 0), first_key_tile);
  }
};

// The block's steps: the (query head, query tile) pairs that see some key of the block, query tiles fastest; step s
// lives in stage s % kStages, its barriers in their (s / kStages)-th phase (as the forward's key tiles).
struct BwdSteps {
  int64_t h_first;  // the first query head visited
  int m_first;      // the first query tile that sees the block's keys (causal), else 0
  int m_tiles;      // query tiles per head from m_first on
  int count;        // heads visited x m_tiles
  __device__ int64_t head(int s) const { return h_first + s / m_tiles; }
  __device__ int m_tile(int s) const { return m_first + s % m_tiles; }
};
template <class Traits>
__device__ __forceinline__ int bwd_stage(int s) { return s % Traits::kStages; }
template <class Traits>
__device__ __forceinline__ uint32_t bwd_phase(int s) { return static_cast<uint32_t>((s / Traits::kStages) & 1); }

// ---- the producer -----------------------------------------------------------------------------------------------------
// One thread issues the copies. The per-row statistics come from the delta kernel's workspace (flash_cuda.h:
// bwd_row_stats_floats): a copy stops at the end of the sequence's rows rounded up to 4, so that it never reads past the
// workspace; the rows it leaves out are past q_len and masked.
template <class Traits>
__device__ __forceinline__ void load_kv_tiles(const BwdSharedTiles<Traits>& sm, const CUtensorMap* tm_k,
                                              const CUtensorMap* tm_v, const SequenceRows& seq, int64_t hk, int n0) {
  mbarrier_arrive_expect_tx(sm.kv_full, 2 * Traits::kKVBytes);
#pragma unroll
  for (int panel = 0; panel < Traits::kPanels; ++panel) {
    tma_load_4d(sm.k + panel * Traits::kKVPanelBytes, tm_k, sm.kv_full, panel * Traits::kPanelCols,
                seq.k_row0 + n0, static_cast<int>(hk), seq.bm);
    tma_load_4d(sm.v + panel * Traits::kKVPanelBytes, tm_v, sm.kv_full, panel * Traits::kPanelCols,
                seq.k_row0 + n0, static_cast<int>(hk), seq.bm);
  }
}

// Where a (b, h)'s rows start in the statistics' workspace, and how many of them a copy may read.
struct StatRows {
  const float* delta;  // D of head h from h · head_stride on
  const float* lse2;   // lse·log2e, the same
  int64_t head_stride, q_pad;
};
__device__ __forceinline__ StatRows stat_rows(const AttentionParams& p, const float* stats, const SequenceRows& seq,
                                              int64_t b) {
  const float* delta = stats + bwd_stats_row0(p, b, 0);
  return {delta, delta + bwd_stats_half(p), bwd_stats_head_stride(p), q_padded(seq.q_len)};
}

// Query tile m0 of head h into stage `stage`, whose Q half the consumers have handed back (the caller waited for it):
// Q and lse2, then, once they have handed back its dO half, dO and D. kArrive false (key spans): Q's bytes are only
// announced, the caller arrives on q_full once it has written the step (after the copies, which run meanwhile).
template <class Traits, bool kArrive = true>
__device__ __forceinline__ void load_step_tiles(const BwdSharedTiles<Traits>& sm, const CUtensorMap* tm_q,
                                                const CUtensorMap* tm_do, const StatRows& rows,
                                                const SequenceRows& seq, int64_t h, int m0, int stage,
                                                uint32_t released) {
  const int row = seq.q_row0 + m0;  // in q's and dout's maps
  const int64_t row_at = h * rows.head_stride + m0;
  const uint32_t stat_bytes = 4u * static_cast<uint32_t>(min64(Traits::kBlockM, rows.q_pad - m0));
  if constexpr (kArrive) mbarrier_arrive_expect_tx(&sm.q_full[stage], Traits::kQBytes + stat_bytes);
  else mbarrier_expect_tx(&sm.q_full[stage], Traits::kQBytes + stat_bytes);
#pragma unroll
  for (int panel = 0; panel < Traits::kPanels; ++panel)
    tma_load_4d(sm.q_tile(stage) + panel * Traits::kQPanelBytes, tm_q, &sm.q_full[stage],
                panel * Traits::kPanelCols, row, static_cast<int>(h), seq.bm);
  bulk_load(sm.lse2_rows(stage), rows.lse2 + row_at, stat_bytes, &sm.q_full[stage]);

  mbarrier_wait(&sm.do_empty[stage], released);
  mbarrier_arrive_expect_tx(&sm.do_full[stage], Traits::kQBytes + stat_bytes);
#pragma unroll
  for (int panel = 0; panel < Traits::kPanels; ++panel)
    tma_load_4d(sm.do_tile(stage) + panel * Traits::kQPanelBytes, tm_do, &sm.do_full[stage],
                panel * Traits::kPanelCols, row, static_cast<int>(h), seq.bm);
  bulk_load(sm.delta_rows(stage), rows.delta + row_at, stat_bytes, &sm.do_full[stage]);
}

// The plain, causal and packed kernels' producer: one thread, the steps known in advance (BwdSteps).
template <class Traits>
__device__ __forceinline__ void load_bwd_tiles(const BwdSharedTiles<Traits>& sm, const CUtensorMap* tm_q,
                                               const CUtensorMap* tm_do, const CUtensorMap* tm_k,
                                               const CUtensorMap* tm_v, const AttentionParams& p, const float* stats,
                                               const BwdSteps& steps, const SequenceRows& seq, int64_t b, int64_t hk,
                                               int n0) {
  load_kv_tiles<Traits>(sm, tm_k, tm_v, seq, hk, n0);
  const StatRows rows = stat_rows(p, stats, seq, b);
  for (int s = 0; s < steps.count; ++s) {
    const int stage = bwd_stage<Traits>(s);
    const uint32_t released = bwd_phase<Traits>(s) ^ 1;  // the phase in which step s − kStages was handed back
    mbarrier_wait(&sm.q_empty[stage], released);
    load_step_tiles<Traits>(sm, tm_q, tm_do, rows, seq, steps.head(s), steps.m_tile(s) * Traits::kBlockM, stage,
                            released);
  }
}

// Bits lo .. hi − 1 of a word, clamped to 0 .. 31 (none when hi <= lo).
__device__ __forceinline__ uint32_t bit_range(int lo, int hi) {
  const uint32_t below_hi = hi >= 32 ? 0xffffffffu : (1u << max(hi, 0)) - 1u;
  const uint32_t below_lo = lo >= 32 ? 0xffffffffu : (1u << max(lo, 0)) - 1u;
  return below_hi & ~below_lo;
}

// Key spans: which of the keys n0 .. n0 + 127 each row of query tile m0 sees, 4 words a row (bit l of word w: key
// n0 + 32w + l), a lane a row: the keys of the row's span (flash_mask.cuh's key_span), and where the row is not exact,
// of those only the ones whose boolean attn_mask entry is true (entries are read only there: 16 or 4 at a time where
// the row's 128 are contiguous, aligned and inside the mask, else one at a time).
template <class Traits>
__device__ __forceinline__ void write_row_bits(uint32_t* bits, const AttentionParams& p, int64_t b, int64_t h, int m0,
                                               int n0, int lane) {
  const Logits logits(p, b, h);  // (attn_mask's entries of this (b, h), if any)
  for (int r = lane; r < Traits::kBlockM; r += 32) {
    const KeySpan span = key_span(p, b, h, m0 + r);
    uint32_t word[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) word[w] = bit_range(span.lo - (n0 + 32 * w), span.hi - (n0 + 32 * w));
    if (!span.exact) {
      const char* entries = logits.mask + static_cast<int64_t>(m0 + r) * logits.mask_row;
      const char* at = entries + static_cast<int64_t>(n0) * logits.mask_key;
      const uintptr_t address = reinterpret_cast<uintptr_t>(at);
      if (logits.mask_key == 1 && n0 + 128 <= p.kv_len && address % 16 == 0) {
        // The row's 128 entries in 8 loads of 16 bytes: a byte that is 0 clears its key's bit.
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const uint4 x = reinterpret_cast<const uint4*>(at)[c];
          const uint32_t bytes[4] = {x.x, x.y, x.z, x.w};
          uint32_t seen = 0;  // bit k: entry 16c + k is not 0
#pragma unroll
          for (int k = 0; k < 16; ++k)
            seen |= static_cast<uint32_t>(((bytes[k / 4] >> (8 * (k % 4))) & 0xffu) != 0) << k;
          word[c / 2] &= ~((~seen & 0xffffu) << (16 * (c % 2)));
        }
      } else if (logits.mask_key == 1 && n0 + 128 <= p.kv_len && address % 4 == 0) {
        // (rows of a kv_len that is a multiple of 4 but not of 16) 32 loads of 4 bytes, unrolled: several in flight.
#pragma unroll
        for (int c = 0; c < 32; ++c) {
          const uint32_t bytes = reinterpret_cast<const uint32_t*>(at)[c];
          uint32_t seen = 0;  // bit k: entry 4c + k is not 0
#pragma unroll
          for (int k = 0; k < 4; ++k) seen |= static_cast<uint32_t>(((bytes >> (8 * k)) & 0xffu) != 0) << k;
          word[c / 8] &= ~((~seen & 0xfu) << (4 * (c % 8)));
        }
      } else {
#pragma unroll
        for (int w = 0; w < 4; ++w)
          for (uint32_t left = word[w]; left != 0; left &= left - 1) {
            const int key = n0 + 32 * w + __ffs(left) - 1;
            if (*reinterpret_cast<const uint8_t*>(entries + key * logits.mask_key) == 0)
              word[w] &= ~(1u << (__ffs(left) - 1));
          }
      }
    }
    reinterpret_cast<uint4*>(bits)[r] = make_uint4(word[0], word[1], word[2], word[3]);
  }
}

// The key spans kernel's producer: warp 0 of the producer warpgroup (lane 0 issues the copies). For each query head
// h_first .. h_first + heads − 1, the lanes read 32 query tiles' entries of the table (span_tiles: flash_cuda.h) at a
// time and keep those that some row sees a key of [n0, n0 + kBlockN) in; each kept tile is a step. A step whose tile
// is not inside every row's exact span, or runs past q_len or kv_len, needs the mask: the lanes first write its rows'
// bits to the stage. After the last step, a step marked empty.
template <class Traits>
__device__ __forceinline__ void load_bwd_tiles_spans(const BwdSharedTiles<Traits>& sm, const CUtensorMap* tm_q,
                                                     const CUtensorMap* tm_do, const CUtensorMap* tm_k,
                                                     const CUtensorMap* tm_v, const AttentionParams& p,
                                                     const float* stats, const int4* span_tiles,
                                                     const SequenceRows& seq, int64_t b, int64_t hk, int64_t h_first,
                                                     int heads, int n0) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kPer = kBlockM / kBwdSpanTileRows;
  const int lane = threadIdx.x % 32;
  if (lane == 0) load_kv_tiles<Traits>(sm, tm_k, tm_v, seq, hk, n0);
  const StatRows rows = stat_rows(p, stats, seq, b);
  const int table_tiles = (seq.q_len + kBwdSpanTileRows - 1) / kBwdSpanTileRows;
  const int m_tiles = (seq.q_len + kBlockM - 1) / kBlockM;
  const int n_end = n0 + kBlockN;
  const bool keys_whole = n_end <= seq.kv_len;
  int s = 0;
  for (int64_t h = h_first; h < h_first + heads; ++h) {
    const int4* tiles = span_tiles + (b * p.num_heads + h) * table_tiles;
    for (int base = 0; base < m_tiles; base += 32) {
      // Lane l: query tile base + l, from its kPer entries of the table.
      const int m_tile = base + lane;
      SpanSummary tile;
      if (m_tile < m_tiles) {
#pragma unroll
        for (int e = 0; e < kPer; ++e) {
          const int t = m_tile * kPer + e;
          tile.merge(SpanSummary::from(t < table_tiles ? tiles[t] : make_int4(INT_MAX, 0, 0, 0)));
        }
      }
      const bool sees = m_tile < m_tiles && tile.first < tile.end && tile.first < n_end && tile.end > n0;
      const bool whole =
          keys_whole && (m_tile + 1) * kBlockM <= seq.q_len && tile.full_lo <= n0 && n_end <= tile.full_hi;
      uint32_t visit = __ballot_sync(0xffffffffu, sees);
      const uint32_t masked = __ballot_sync(0xffffffffu, sees && !whole);
      while (visit != 0) {  // (visit is the warp's: every lane runs these iterations)
        const int i = __ffs(visit) - 1;
        visit &= visit - 1;
        const int first_key_tile = __shfl_sync(0xffffffffu, tile.first, i) / kBlockN;
        const int stage = bwd_stage<Traits>(s);
        const uint32_t released = bwd_phase<Traits>(s) ^ 1;
        const int m0 = (base + i) * kBlockM;
        const bool needs_mask = (masked >> i) & 1u;
        mbarrier_wait(&sm.q_empty[stage], released);
        // The copies first (Q's bytes announced, not arrived), the bits while they run, then the step and the arrival
        // on q_full that releases them with it (after the lanes' bits: __syncwarp).
        if (lane == 0) load_step_tiles<Traits, false>(sm, tm_q, tm_do, rows, seq, h, m0, stage, released);
        if (needs_mask) write_row_bits<Traits>(sm.bits_of(stage), p, b, h, m0, n0, lane);
        __syncwarp();
        if (lane == 0) {
          sm.steps[stage] = BwdStep{static_cast<int>(h), base + i, needs_mask, true, first_key_tile}.packed();
          mbarrier_arrive(&sm.q_full[stage]);
        }
        ++s;
      }
    }
  }
  // The end: a step marked empty, in the next stage once the consumers have handed it back.
  const int stage = bwd_stage<Traits>(s);
  mbarrier_wait(&sm.q_empty[stage], bwd_phase<Traits>(s) ^ 1);
  if (lane == 0) {
    sm.steps[stage] = BwdStep{0, 0, false, false, 0}.packed();
    mbarrier_arrive(&sm.q_full[stage]);
  }
}

// ---- the consumers' products ------------------------------------------------------------------------------------------
// Sᵀ = K_w Qᵀ (or dPᵀ = V_w dOᵀ), 64 keys x kBlockM queries: head_dim / 16 k-steps, step kk 32·(kk % 4) bytes into the
// rows of panel kk / 4 of both tiles (K-major, 1024 bytes between 8-row atoms; the forward's S = Q Kᵀ with the roles
// of the operands swapped). Issued and committed, not waited.
template <class Traits>
__device__ __forceinline__ void gemm_keys_x_queries(float (&acc)[Traits::kBlockM / 2], const char* keys_w,
                                                    const char* rows_tile) {
  const uint64_t desc_a = smem_desc_sw128(keys_w, 16, 1024), desc_b = smem_desc_sw128(rows_tile, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk) {
    const int panel = kk / 4, bytes = (kk % 4) * 32;
    wgmma_ss<Traits::kBlockM, typename Traits::T>(acc, desc_advance(desc_a, panel * Traits::kKVPanelBytes + bytes),
                                                  desc_advance(desc_b, panel * Traits::kQPanelBytes + bytes), kk > 0);
  }
  wgmma_commit();
}

// acc += Aᵀ-fragments · rows (dV += Pᵀ dO, dK += dSᵀ Q), 64 keys x head_dim: kBlockM / 16 k-steps, step kk the query
// rows 16·kk .. 16·kk + 15, i.e. 2048·kk bytes into every panel of the tile, read MN-major (head_dim along its rows;
// the forward's O += P V with dO or Q for V). Issued, not committed.
template <class Traits>
__device__ __forceinline__ void gemm_keys_x_dim(float (&acc)[Traits::kHeadDim / 2],
                                                const uint32_t (&a)[Traits::kBlockM / 16][4], const char* rows_tile) {
  const uint64_t desc = smem_desc_sw128(rows_tile, Traits::kQPanelBytes, 1024);
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk)
    wgmma_rs<Traits::kHeadDim, typename Traits::T>(acc, a[kk], desc_advance(desc, kk * 16 * Traits::kRowBytes), 1);
}

// dQ block = dS K_j, 64 queries x 64 columns of head_dim, over the block's kBlockN keys: kBlockN / 16 k-steps, step kk
// the keys 16·kk .. 16·kk + 15, i.e. 2048·kk bytes into dSᵀ's panel of these 64 queries and into K's panel of these
// 64 columns; both MN-major (keys along K, the 64 queries, or columns, along the 128-byte rows). Issued and committed.
template <class Traits>
__device__ __forceinline__ void gemm_dq(float (&dq)[32], const char* ds_panel, const char* k_panel) {
  const uint64_t desc_ds = smem_desc_sw128(ds_panel, Traits::kDsPanelBytes, 1024);
  const uint64_t desc_k = smem_desc_sw128(k_panel, Traits::kKVPanelBytes, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk)
    wgmma_ss_mn<64, typename Traits::T>(dq, desc_advance(desc_ds, kk * 16 * Traits::kRowBytes),
                                        desc_advance(desc_k, kk * 16 * Traits::kRowBytes), kk > 0);
  wgmma_commit();
}

// ---- the consumers' elementwise steps, on the accumulator fragment (ptx.cuh) ------------------------------------------
// Each thread holds two key rows of its warp's 16: r = 0 (key g) in x[4j], x[4j+1], r = 1 (key g + 8) in x[4j+2],
// x[4j+3], at query columns 8j + 2t, 8j + 2t + 1 (g = lane / 4, t = lane % 4).

// Where a step's tile needs a mask, and the mask in tile coordinates: key kj (0 .. kBlockN − 1) is visible to query
// row qi (0 .. kBlockM − 1) iff kj < keys_valid, qi < rows_valid and (causal) kj − qi <= diag.
struct TileMask {
  bool needed;
  int keys_valid, rows_valid, diag;
  __device__ bool visible(int kj, int qi, bool causal) const {
    return kj < keys_valid && qi < rows_valid && (!causal || kj - qi <= diag);
  }
};
template <class Traits, bool kIsCausal>
__device__ __forceinline__ TileMask tile_mask(const SequenceRows& seq, int n0, int m0) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  TileMask mask;
  mask.keys_valid = min(kBlockN, seq.kv_len - n0);
  mask.rows_valid = min(kBlockM, seq.q_len - m0);
  const int diag = m0 + seq.causal_offset - n0;
  mask.diag = max(-(kBlockM + kBlockN), min(diag, kBlockM + kBlockN));
  mask.needed = mask.keys_valid < kBlockN || mask.rows_valid < kBlockM || (kIsCausal && diag < kBlockN - 1);
  return mask;
}

// Whether column group j (queries 8j .. 8j + 7) of Pᵀ takes its exponentials from exp2_poly (Traits::kPolyExpEvery).
template <class Traits>
__device__ __forceinline__ constexpr bool poly_exp_group(int j) {
  constexpr int every = Traits::kPolyExpEvery;
  return every > 0 && (j + 1) % (every > 0 ? every : 1) == 0;
}

// The thread's per-query statistics of a stage (lse·log2e or D): query columns 8j + 2(lane % 4) and + 1 of Sᵀ's
// fragment, as float2 j: read from shared memory where used (StageStats), or into registers beforehand (HeldStats).
struct StageStats {
  const float* rows;
  int lane;
  __device__ __forceinline__ float2 operator[](int j) const {
    return *reinterpret_cast<const float2*>(rows + 8 * j + 2 * (lane % 4));
  }
};
template <int kCount>
struct HeldStats {
  float2 x[kCount];
  __device__ __forceinline__ explicit HeldStats(const StageStats& from) {
#pragma unroll
    for (int j = 0; j < kCount; ++j) x[j] = from[j];
  }
  __device__ __forceinline__ float2 operator[](int j) const { return x[j]; }
};

// Pᵀ = exp2(scale·log2e · Sᵀ − lse2), in place; with kMasked, masked entries 0 (a select: the statistics of rows past
// q_len are never written, and may be anything). key0: the tile key of the thread's row g.
template <class Traits, bool kIsCausal, bool kMasked, class Stats>
__device__ __forceinline__ void scores_to_probs(float (&s)[Traits::kBlockM / 2], const Stats& lse2,
                                                const TileMask& mask, int key0, float scale_log2, int lane) {
#pragma unroll
  for (int j = 0; j < Traits::kBlockM / 8; ++j) {
    const float2 l = lse2[j];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float arg = fmaf(s[4 * j + e], scale_log2, -(e % 2 ? l.y : l.x));
      const float x = poly_exp_group<Traits>(j) ? exp2_poly(arg) : exp2_approx(arg);
      const int qi = 8 * j + 2 * (lane % 4) + e % 2;
      s[4 * j + e] = !kMasked || mask.visible(key0 + 8 * (e / 2), qi, kIsCausal) ? x : 0.f;
    }
  }
}

// Key spans, a step that needs the mask: Pᵀ as scores_to_probs, key kj of the tile visible to query row qi iff bit kj
// of the row's 128 is set (the stage's bits, which the producer wrote). The thread's keys key0 and key0 + 8 are bits
// key0 % 32 and key0 % 32 + 8 of one word (key0 % 32 < 24). Hidden entries are set to 0, never multiplied.
template <class Traits, class Stats>
__device__ __forceinline__ void scores_to_probs_bits(float (&s)[Traits::kBlockM / 2], const Stats& lse2,
                                                     const uint32_t* bits, int key0, float scale_log2, int lane) {
  const uint32_t* words = bits + key0 / 32;
  const int shift = key0 % 32;
#pragma unroll
  for (int j = 0; j < Traits::kBlockM / 8; ++j) {
    const float2 l = lse2[j];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint32_t w = words[4 * (8 * j + 2 * (lane % 4) + c)] >> shift;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int e = 2 * r + c;
        const float arg = fmaf(s[4 * j + e], scale_log2, -(c ? l.y : l.x));
        const float x = poly_exp_group<Traits>(j) ? exp2_poly(arg) : exp2_approx(arg);
        s[4 * j + e] = (w >> (8 * r)) & 1u ? x : 0.f;
      }
    }
  }
}

// dSᵀ = Pᵀ ∘ (dPᵀ − D), in place of dPᵀ; kMasked: where Pᵀ was masked, 0 (its D may be anything).
template <class Traits, bool kMasked, class Stats>
__device__ __forceinline__ void probs_to_dscores(float (&dp)[Traits::kBlockM / 2],
                                                 const float (&pt)[Traits::kBlockM / 2], const Stats& delta) {
#pragma unroll
  for (int j = 0; j < Traits::kBlockM / 8; ++j) {
    const float2 d = delta[j];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float ds = pt[4 * j + e] * (dp[4 * j + e] - (e % 2 ? d.y : d.x));
      dp[4 * j + e] = !kMasked || pt[4 * j + e] != 0.f ? ds : 0.f;
    }
  }
}

// A fragment in T, as the A operand of a product over the queries: k-slice kk (queries 16kk .. 16kk + 15) is
// x[8kk .. 8kk + 7], two at a time (ptx.cuh).
template <class Traits>
__device__ __forceinline__ void to_a_frags(uint32_t (&a)[Traits::kBlockM / 16][4], const float (&x)[Traits::kBlockM / 2]) {
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[kk][r] = pack2<typename Traits::T>(x[8 * kk + 2 * r], x[8 * kk + 2 * r + 1]);
}

// The warpgroup's 64 key rows of dSᵀ (its A fragments) into the shared dSᵀ tile: a[kk][r] is (key g + 8·(r % 2),
// queries 16kk + 8·(r / 2) + 2t, +1); query q of key row `key` lives in panel q / 64, at chunk ((q % 64) / 8) ^ (key % 8)
// of the row (the 128-byte swizzle wgmma reads): a quad's 4-byte stores hit 32 different banks.
template <class Traits>
__device__ __forceinline__ void store_dscores(char* ds_tile, const uint32_t (&a)[Traits::kBlockM / 16][4], int key0,
                                              int lane) {
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int key = key0 + 8 * (r % 2), q = 16 * kk + 8 * (r / 2) + 2 * (lane % 4);
      char* at = ds_tile + (q / 64) * Traits::kDsPanelBytes + key * Traits::kRowBytes +
                 ((((q % 64) / 8) ^ (key % 8)) * 16) + (q % 8) * 2;
      *reinterpret_cast<uint32_t*>(at) = a[kk][r];
    }
}

// dq_accum[i, :] += the warpgroup's 64 x 64 dQ block (a wgmma accumulator fragment), rows past q_len dropped: one
// 16-byte reduction per 4 columns. Lanes t and t ^ 1 of a quad swap halves (as flash_bwd.cuh's add_dq): the even lane
// then holds row g, columns 8j + 4(t / 2) .. + 3, the odd lane row g + 8, the same columns.
__device__ __forceinline__ void add_dq_block(float* dq_rows, int64_t q_len, int64_t head_dim, int64_t row0, int col0,
                                             const float (&dq)[32], int lane) {
  const bool odd = lane % 2;
  const int64_t i = row0 + lane / 4 + (odd ? 8 : 0);
  float* dst = dq_rows + i * head_dim + col0 + (lane % 4 / 2) * 4;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float send0 = odd ? dq[4 * j] : dq[4 * j + 2], send1 = odd ? dq[4 * j + 1] : dq[4 * j + 3];
    const float got0 = __shfl_xor_sync(0xffffffff, send0, 1), got1 = __shfl_xor_sync(0xffffffff, send1, 1);
    const float4 v = odd ? make_float4(got0, got1, dq[4 * j + 2], dq[4 * j + 3])
                         : make_float4(dq[4 * j], dq[4 * j + 1], got0, got1);
    if (i < q_len) atomic_add4(dst + 8 * j, v);
  }
}

// The warpgroup's 64 x 64 dQ block (a wgmma accumulator fragment) into its shared-memory boxes, as TMA lays out a
// (32 columns, 64 rows) float32 box under the 128-byte swizzle: column c of row r in box c / 32, at chunk
// ((c % 32) / 4) ^ (r % 8) of the 128-byte row. Each 8-byte store of a warp covers every bank twice (no conflict).
template <class Traits>
__device__ __forceinline__ void store_dq_block(char* dq_block, const float (&dq)[32], int warp, int lane) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * warp + lane / 4 + 8 * r, c = 8 * (j % 4) + 2 * (lane % 4);
      char* at = dq_block + (j / 4) * Traits::kDqBoxBytes + row * 128 + (((c / 4) ^ (row % 8)) * 16) + (c % 4) * 4;
      *reinterpret_cast<float2*>(at) = make_float2(dq[4 * j + 2 * r], dq[4 * j + 2 * r + 1]);
    }
}

// dK·scale (or dV) of the warpgroup's 64 keys, from its accumulator fragment, rows past kv_len dropped.
template <class Traits>
__device__ __forceinline__ void write_dkv(typename Traits::T* out, int64_t row_stride, int64_t kv_len, int64_t key0,
                                          const float (&acc)[Traits::kHeadDim / 2], float scale, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = key0 + 8 * r;
    if (key < kv_len) {
      typename Traits::T* row = out + key * row_stride + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < Traits::kHeadDim / 8; ++j)
        *reinterpret_cast<uint32_t*>(row + 8 * j) =
            pack2<typename Traits::T>(acc[4 * j + 2 * r] * scale, acc[4 * j + 2 * r + 1] * scale);
    }
  }
}

// Named barriers (id; 0 is __syncthreads'): both consumer warpgroups have written their halves of a step's dSᵀ; the
// four warps of consumer warpgroup w have written its dQ block (kDqWrittenBarrier + w), or zeroed its keys past the
// sequence (kKeysZeroedBarrier + w); both have zeroed a stage's rows past the sequence (kRowsZeroedBarrier).
constexpr int kDsWrittenBarrier = 1;
constexpr int kDqWrittenBarrier = 2;
constexpr int kKeysZeroedBarrier = 4;
constexpr int kRowsZeroedBarrier = 6;

// The deterministic order of dQ's additions (AttentionBackwardParams::dq_tickets). The key tiles that add into query
// tile m are consecutive: key tiles 0, 1, ... of its batch element or packed sequence, or with key spans those from
// the tile's first one on. A block adds its dQ block of tile m once the counter of (batch, head h, m, warpgroup) has
// reached its rank among them (the key tiles before its own have added theirs), and counts it on once its additions
// are done. Blocks start in key order (grid order, grouped_heavy_first), so a block waits only on started ones.
// (The counter is found from bp's fields where it is used: no register of the loop holds it.)

// kDqTma: once each of the warpgroup's threads has written its part of the dQ block to shared memory, one thread adds
// the block into rows row .. row + 63 of head h's dq_accum (two bulk tensor reduce-adds, committed as one group);
// rank: the block's among the key tiles adding into these rows (the deterministic order's; the counter is the one of
// row `row` of batch bm and warpgroup wg, which no other query tile's block shares: each tile's first row differs).
template <class Traits>
__device__ __forceinline__ void reduce_dq_block(const BwdSharedTiles<Traits>& sm, const CUtensorMap* tm_dq, int wg,
                                                int warp, int lane, int col0, int row, int h, int bm,
                                                const AttentionBackwardParams& bp, int rank) {
  fence_proxy_async();  // the copy engine reads what this thread's stores wrote
  if (warp == 0) {
    named_barrier_sync(kDqWrittenBarrier + wg, 128);
    if (lane == 0) {
      int* ticket = nullptr;
      if (bp.dq_tickets != nullptr) {
        ticket = bp.dq_tickets + ((static_cast<int64_t>(bm) * bp.fwd.num_heads + h) * bp.dq_ticket_rows + row) * 2 + wg;
        wait_for_turn(ticket, rank);
        fence_proxy_async_global();  // the reductions below come after the ones the counter counted
      }
#pragma unroll
      for (int box = 0; box < 2; ++box)
        tma_reduce_add_4d(tm_dq, sm.dq_block(wg) + box * Traits::kDqBoxBytes, col0 + 32 * box, row, h, bm);
      bulk_commit_group();
      if (ticket != nullptr) {
        bulk_wait_group<0>();  // the additions are done
        fence_proxy_async_global();
        add_release_gpu(ticket, 1);
      }
    }
  } else {
    named_barrier_arrive(kDqWrittenBarrier + wg, 128);
  }
}

// ---- the consumers' mainloop --------------------------------------------------------------------------------------------
// Per step (query head h, query tile at m0), the products in five groups: {Sᵀ}, {dPᵀ}, {dV}, then after the barrier
// {dQ}, {dK}. The exponentials of Pᵀ run while dPᵀ is on the tensor cores, the stores of dSᵀ and the barrier while dV
// is (with kDvEarly also dSᵀ's arithmetic), and dQ's way to shared memory while dK is (FlashAttention-3's order), its
// reduction into dq_accum then (or with kDqDefer under the next step's Sᵀ and dPᵀ).
// Key spans: the steps come from the producer (BwdStep in the stage), until one marked empty.
template <class Traits, int kMask, bool kPacked>
__device__ __forceinline__ void consumer_mainloop(const BwdSharedTiles<Traits>& sm, const AttentionParams& p,
                                                  const BwdSteps& steps, const SequenceRows& seq, float* dq_accum,
                                                  const CUtensorMap* tm_dq, const AttentionBackwardParams& bp,
                                                  int64_t b, int64_t n0, int wg, float (&dk)[Traits::kHeadDim / 2],
                                                  float (&dv)[Traits::kHeadDim / 2]) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr bool kIsCausal = kMask == kMaskCausal;
  constexpr bool kDqDefer = Traits::kDqDefer;
  // Br 64 (d 128): the rows' lse·log2e and D go to registers on arrival, ahead of the products' operand reads in the
  // shared-memory pipe (after them, their loads waited behind those reads); Br 128 (d 64) reads them where used (their
  // 64 registers would pass the consumers' 240).
  using Stats = std::conditional_t<(kBlockM <= 64), HeldStats<kBlockM / 8>, StageStats>;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int key0 = wg * 64 + warp * 16 + lane / 4;  // the tile key of the thread's row g
  const float scale_log2 = p.scale * kLog2e;
  const char* k_w = sm.k + wg * 64 * Traits::kRowBytes;  // the warpgroup's 64 keys of every K (V) panel
  const char* v_w = sm.v + wg * 64 * Traits::kRowBytes;
  // The warpgroup's dQ block: query rows dq_row0 .. + 63 of the tile, head_dim columns dq_col0 .. + 63.
  const int dq_row0 = Traits::kDqSplitByRows ? wg * 64 : 0;
  const int dq_col0 = Traits::kDqSplitByRows ? 0 : wg * 64;
  const int64_t head_dim = Traits::kHeadDim;

  mbarrier_wait(sm.kv_full, 0);
  if (kPacked && seq.kv_len - n0 < Traits::kBlockN) {
    // The warpgroup's keys past the sequence's, for dQ = dS K. Its own barrier orders them before its Sᵀ = K_w Qᵀ;
    // the other warpgroup reads them only in dQ's product, after step 0's kDsWrittenBarrier (both warpgroups pass it
    // after these stores and this fence).
    const int own = max(0, min(64, seq.kv_len - static_cast<int>(n0) - wg * 64));
    zero_rows<Traits::kPanels>(sm.k + wg * 64 * Traits::kRowBytes, Traits::kKVPanelBytes, own, 64, threadIdx.x % 128,
                               128);
    fence_proxy_async();  // the tensor cores read them after
    named_barrier_sync(kKeysZeroedBarrier + wg, 128);
  }
  // kDqDefer: the dQ block in shared memory whose reduction is still to be issued, and its rows and head.
  bool dq_pending = false;
  int dq_pending_row = 0, dq_pending_h = 0, dq_pending_first = 0;
  // Step s visits query tile m_tile of head h (steps.head(s), steps.m_tile(s), counted on instead of divided out).
  int64_t h = steps.h_first;
  int m_tile = steps.m_first;
  int first_key_tile = 0;  // (key spans: the step's; else the key tiles adding into a query tile start at 0)
  const int key_tile = static_cast<int>(n0 / Traits::kBlockN);
  for (int s = 0; kMask == kMaskSpans || s < steps.count; ++s) {
    const int stage = bwd_stage<Traits>(s);
    const uint32_t phase = bwd_phase<Traits>(s);
    bool spans_masked = false;
    if constexpr (kMask == kMaskSpans) {
      mbarrier_wait(&sm.q_full[stage], phase);
      const BwdStep step = BwdStep::from(sm.steps[stage]);
      if (!step.valid) break;
      h = step.h;
      m_tile = step.m_tile;
      spans_masked = step.needs_mask;
      first_key_tile = step.first_key_tile;
    }
    const int64_t m0 = static_cast<int64_t>(m_tile) * kBlockM;
    const TileMask mask = tile_mask<Traits, kIsCausal>(seq, static_cast<int>(n0), static_cast<int>(m0));
    const bool masked = kMask == kMaskSpans ? spans_masked : mask.needed;
    const char* q_tile = sm.q_tile(stage);
    const char* do_tile = sm.do_tile(stage);
    if (kPacked && mask.rows_valid < kBlockM) {
      // The sequence's last query tile: its rows past the sequence's, for dK += dSᵀ Q and dV += Pᵀ dO, which both
      // warpgroups read whole (so all 256 threads zero them, and wait for each other).
      const int tid = threadIdx.x - 128, threads = 128 * Traits::kConsumerWarpgroups;
      mbarrier_wait(&sm.q_full[stage], phase);
      mbarrier_wait(&sm.do_full[stage], phase);
      zero_rows<Traits::kPanels>(sm.q_tile(stage), Traits::kQPanelBytes, mask.rows_valid, kBlockM, tid, threads);
      zero_rows<Traits::kPanels>(sm.do_tile(stage), Traits::kQPanelBytes, mask.rows_valid, kBlockM, tid, threads);
      fence_proxy_async();
      named_barrier_sync(kRowsZeroedBarrier, threads);
    }

    // Sᵀ = K_w Qᵀ and dPᵀ = V_w dOᵀ, both in flight.
    float st[kBlockM / 2], dpt[kBlockM / 2];
#pragma unroll
    for (int i = 0; i < kBlockM / 2; ++i) st[i] = dpt[i] = 0.f;
    mbarrier_wait(&sm.q_full[stage], phase);
    const Stats lse2(StageStats{sm.lse2_rows(stage), lane});
    gemm_keys_x_queries<Traits>(st, k_w, q_tile);
    mbarrier_wait(&sm.do_full[stage], phase);
    const Stats delta(StageStats{sm.delta_rows(stage), lane});
    gemm_keys_x_queries<Traits>(dpt, v_w, do_tile);
    if (kDqDefer && dq_pending)  // the previous step's dQ block, under these two products
      reduce_dq_block<Traits>(sm, tm_dq, wg, warp, lane, dq_col0, dq_pending_row, dq_pending_h, seq.bm, bp,
                              key_tile - dq_pending_first);

    // Pᵀ (under dPᵀ's product), then dSᵀ.
    wgmma_wait<1>();
    fence_fragment(st);
    if (kMask == kMaskSpans && masked)
      scores_to_probs_bits<Traits>(st, lse2, sm.bits_of(stage), key0, scale_log2, lane);
    else if (kMask != kMaskSpans && masked)
      scores_to_probs<Traits, kIsCausal, true>(st, lse2, mask, key0, scale_log2, lane);
    else
      scores_to_probs<Traits, kIsCausal, false>(st, lse2, mask, key0, scale_log2, lane);
    uint32_t pt16[kBlockM / 16][4], dst16[kBlockM / 16][4];
    if constexpr (Traits::kDvEarly) {
      // dV += Pᵀ dO now, under dSᵀ's arithmetic, its stores and the barrier; dPᵀ's group completes before it.
      to_a_frags<Traits>(pt16, st);
      wgmma_fence();
      gemm_keys_x_dim<Traits>(dv, pt16, do_tile);
      wgmma_commit();
      wgmma_wait<1>();
      fence_fragment(dpt);
      if (masked) probs_to_dscores<Traits, true>(dpt, st, delta);
      else probs_to_dscores<Traits, false>(dpt, st, delta);
      to_a_frags<Traits>(dst16, dpt);
    } else {
      wgmma_wait<0>();
      fence_fragment(dpt);
      if (masked) probs_to_dscores<Traits, true>(dpt, st, delta);
      else probs_to_dscores<Traits, false>(dpt, st, delta);
      to_a_frags<Traits>(pt16, st);
      to_a_frags<Traits>(dst16, dpt);

      // dV += Pᵀ dO, under the stores of dSᵀ and the barrier.
      wgmma_fence();
      gemm_keys_x_dim<Traits>(dv, pt16, do_tile);
      wgmma_commit();
    }

    // dSᵀ to shared memory for dQ. Its buffer was last read by the dQ product of step s − 2, which both warpgroups
    // waited for before they reached the barrier of step s − 1.
    char* ds_tile = sm.ds_tile(s);
    store_dscores<Traits>(ds_tile, dst16, key0, lane);
    fence_proxy_async();  // the tensor cores read what these stores wrote
    // kDqTma: the reduction of step s − 1 has read the dQ block before any thread of the warpgroup passes this barrier
    // and writes it again.
    if (Traits::kDqTma && threadIdx.x % 128 == 0) bulk_wait_group_read<0>();
    named_barrier_sync(kDsWrittenBarrier, 256);

    // The warpgroup's dQ block = dS K_j, then dK += dSᵀ Q; dQ's reductions run under the latter.
    float dq[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) dq[i] = 0.f;
    gemm_dq<Traits>(dq, ds_tile + (dq_row0 / 64) * Traits::kDsPanelBytes,
                    sm.k + (dq_col0 / 64) * Traits::kKVPanelBytes);
    wgmma_fence();
    gemm_keys_x_dim<Traits>(dk, dst16, q_tile);
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ are done (groups complete in order): dO is free
    fence_fragment(dq);
    fence_fragment(dv);
    fence_fragment(pt16);
    if constexpr (kPacked) {
      // Rows past the sequence's queries to 0: the reduction below adds them into the next sequence's rows (their dS
      // is 0, but 0 · K is NaN where a key is not finite; dense, TMA drops rows past q_len).
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const bool past = dq_row0 + 16 * warp + lane / 4 + 8 * r >= mask.rows_valid;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          dq[4 * j + 2 * r] = past ? 0.f : dq[4 * j + 2 * r];
          dq[4 * j + 2 * r + 1] = past ? 0.f : dq[4 * j + 2 * r + 1];
        }
      }
    }
    if (lane == 0) mbarrier_arrive(&sm.do_empty[stage]);
    if constexpr (Traits::kDqTma) {
      // The block to shared memory, then into dq_accum (kDqDefer: in the next step).
      store_dq_block<Traits>(sm.dq_block(wg), dq, warp, lane);
      const int dq_row = seq.q_row0 + static_cast<int>(m0) + dq_row0;
      if constexpr (kDqDefer) {
        dq_pending = true;
        dq_pending_row = dq_row;
        dq_pending_h = static_cast<int>(h);
        dq_pending_first = first_key_tile;
      } else {
        reduce_dq_block<Traits>(sm, tm_dq, wg, warp, lane, dq_col0, dq_row, static_cast<int>(h), seq.bm, bp,
                                key_tile - first_key_tile);
      }
    } else {
      add_dq_block(dq_accum + dq_accum_offset(p, b, h, Traits::kHeadDim), seq.q_len, head_dim,
                   m0 + dq_row0 + warp * 16, dq_col0, dq, lane);
    }
    wgmma_wait<0>();  // dK is done: Q is free
    fence_fragment(dk);
    fence_fragment(dst16);
    if (lane == 0) mbarrier_arrive(&sm.q_empty[stage]);
    if (kMask != kMaskSpans && ++m_tile == steps.m_first + steps.m_tiles) {
      m_tile = steps.m_first;
      ++h;
    }
  }
  if (kDqDefer && dq_pending)
    reduce_dq_block<Traits>(sm, tm_dq, wg, warp, lane, dq_col0, dq_pending_row, dq_pending_h, seq.bm, bp,
                            key_tile - dq_pending_first);
  // The block's shared memory outlives the last reductions' reads.
  if (Traits::kDqTma && threadIdx.x % 128 == 0) bulk_wait_group<0>();
}

// ---- the kernel -------------------------------------------------------------------------------------------------------
// Grid and GQA as flash_bwd.cuh: (key blocks, batch x kv heads), or with kPerQueryHead (key blocks, batch x query
// heads), each block then writing its query head's share of dK, dV; under a causal mask one dimension in
// grouped_heavy_first's order (a head's first key block sees the most query tiles). span_tiles: key spans' table.
template <class Traits, int kMask, bool kPerQueryHead, bool kPacked>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_hopper_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                            const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                            const __grid_constant__ CUtensorMap tm_dq, const AttentionBackwardParams bp,
                            const float* stats, const int4* span_tiles, float* dq_accum, int heads_per_group) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kD = Traits::kHeadDim;
  const AttentionParams& p = bp.fwd;
  extern __shared__ char smem_raw[];
  char* base = smem_raw + (1024 - smem_u32(smem_raw) % 1024) % 1024;
  const BwdSharedTiles<Traits> sm(base);

  const int64_t heads_here = kPerQueryHead ? p.num_heads : p.num_kv_heads;
  int n_block, bh;
  if constexpr (kMask == kMaskCausal) {
    const int n_blocks = static_cast<int>((p.kv_len + kBlockN - 1) / kBlockN);
    const HeadTile ht = grouped_heavy_first(blockIdx.x, static_cast<int>(p.batch * heads_here), n_blocks,
                                            heads_per_group);
    n_block = ht.tile_rank;
    bh = ht.head;
  } else {
    n_block = blockIdx.x;
    bh = blockIdx.y;
  }
  const int64_t b = bh / heads_here, head = bh % heads_here;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t hk = kPerQueryHead ? head / group : head;
  const int64_t n0 = static_cast<int64_t>(n_block) * kBlockN;
  const SequenceRows seq = sequence_rows(p, b, kPacked);  // (kPacked: its own kernel, which dense calls never pay for)

  // The query tiles that see some key of this block: all, or under the causal mask those with a row
  // i >= n0 − causal_offset; for each query head of the block (one, or the kv head's group). None where the block's
  // keys are past its sequence's (packed: a shorter sequence than the longest). (Key spans: the producer finds them.)
  BwdSteps steps;
  const int m_tiles_all = static_cast<int>((seq.q_len + kBlockM - 1) / kBlockM);
  steps.m_first =
      kMask == kMaskCausal ? static_cast<int>(min64(m_tiles_all, max64(0, n0 - seq.causal_offset) / kBlockM)) : 0;
  steps.m_tiles = n0 < seq.kv_len ? m_tiles_all - steps.m_first : 0;
  steps.h_first = kPerQueryHead ? head : hk * group;
  steps.count = (kPerQueryHead ? 1 : static_cast<int>(group)) * steps.m_tiles;

  if (threadIdx.x == 0) {
    mbarrier_init(sm.kv_full, 1);
#pragma unroll
    for (int s = 0; s < Traits::kStages; ++s) {
      mbarrier_init(&sm.q_full[s], 1);
      mbarrier_init(&sm.do_full[s], 1);
      mbarrier_init(&sm.q_empty[s], 4 * Traits::kConsumerWarpgroups);  // lane 0 of every consumer warp
      mbarrier_init(&sm.do_empty[s], 4 * Traits::kConsumerWarpgroups);
    }
    fence_barrier_init();
  }
  __syncthreads();

  // (broadcast from lane 0: the compiler then knows it is the same across a warp and keeps what derives from it, the
  // wgmma descriptors, in uniform registers)
  const int warpgroup = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x / 128), 0);
  if (warpgroup == 0) {
    // ---- producer ----
    setmaxnreg_dec<Traits::kProducerRegs>();
    if constexpr (kMask == kMaskSpans) {
      if (threadIdx.x < 32)
        load_bwd_tiles_spans<Traits>(sm, &tm_q, &tm_do, &tm_k, &tm_v, p, stats, span_tiles, seq, b, hk, steps.h_first,
                                     kPerQueryHead ? 1 : static_cast<int>(group), static_cast<int>(n0));
    } else if (threadIdx.x == 0 && steps.count > 0) {
      prefetch_tensor_map(&tm_q);
      prefetch_tensor_map(&tm_do);
      prefetch_tensor_map(&tm_k);
      prefetch_tensor_map(&tm_v);
      load_bwd_tiles<Traits>(sm, &tm_q, &tm_do, &tm_k, &tm_v, p, stats, steps, seq, b, hk, static_cast<int>(n0));
    }
  } else {
    // ---- consumers ----
    setmaxnreg_inc<Traits::kConsumerRegs>();
    const int wg = warpgroup - 1;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    float dk[kD / 2], dv[kD / 2];  // the warpgroup's 64 keys x head_dim
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) dk[i] = dv[i] = 0.f;
    if (kMask == kMaskSpans || steps.count > 0)
      consumer_mainloop<Traits, kMask, kPacked>(sm, p, steps, seq, dq_accum, &tm_dq, bp, b, n0, wg, dk, dv);

    // dK (scaled) and dV of the warpgroup's keys, summed over the query heads the block visited; 0 where none saw them.
    using T = typename Traits::T;
    const int64_t key0 = n0 + wg * 64 + warp * 16 + lane / 4;
    T* dk_rows = head_ptr(static_cast<T*>(bp.dk), bp.dk_strides, seq.bm, head) + int64_t{seq.k_row0} * bp.dk_strides[2];
    T* dv_rows = head_ptr(static_cast<T*>(bp.dv), bp.dv_strides, seq.bm, head) + int64_t{seq.k_row0} * bp.dv_strides[2];
    write_dkv<Traits>(dk_rows, bp.dk_strides[2], seq.kv_len, key0, dk, p.scale, lane);
    write_dkv<Traits>(dv_rows, bp.dv_strides[2], seq.kv_len, key0, dv, 1.f, lane);
  }
#endif
}

// ---- the per-row statistics ----------------------------------------------------------------------------------------------
// flash_bwd_delta_kernel's D_i = rowsum(dO_i ∘ O_i) and lse_i·log2e, into the same workspace, with 16-byte loads: head_dim / 8
// lanes a row, each summing 8 products, then a shuffle reduction among them (out and dout rows are 16-byte aligned:
// hopper_bwd_supports).
template <class T, int kHeadDim>
__global__ void flash_bwd_delta_vec_kernel(const AttentionBackwardParams params, float* stats) {
  constexpr int kLanesPerRow = kHeadDim / 8;
  static_assert(32 % kLanesPerRow == 0, "a row's lanes within one warp");
  const AttentionParams& all = params.fwd;  // packed sequences: every sequence, sequence b's below
  const int64_t task = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanesPerRow;
  const int chunk = threadIdx.x % kLanesPerRow;
  int64_t b = 0, h = 0, i = 0;
  const bool valid = task < bwd_stats_tasks(all) && bwd_stats_task(all, task, b, h, i);
  const AttentionBackwardParams bp = sequence_view(params, b);
  const AttentionParams& p = bp.fwd;
  float sum = 0.f;
  if (valid) {
    const T* o = head_ptr(static_cast<const T*>(p.out), p.out_strides, b, h) + i * p.out_strides[2] + chunk * 8;
    const T* dout = head_ptr(static_cast<const T*>(bp.dout), bp.dout_strides, b, h) + i * bp.dout_strides[2] + chunk * 8;
    const uint4 a = *reinterpret_cast<const uint4*>(o), g = *reinterpret_cast<const uint4*>(dout);
    const uint32_t av[4] = {a.x, a.y, a.z, a.w}, gv[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 x = unpack2<T>(av[k]), y = unpack2<T>(gv[k]);
      sum = fmaf(x.x, y.x, fmaf(x.y, y.y, sum));
    }
  }
#pragma unroll
  for (int off = kLanesPerRow / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  if (valid && chunk == 0) {
    const int64_t at = bwd_stats_row0(all, b, h) + i;
    const float lse = p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i];
    stats[at] = sum;
    stats[bwd_stats_half(all) + at] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }
}

// ---- key spans' table of query tiles ---------------------------------------------------------------------------------
// flash_cuda.h's bwd_span_tiles (after the statistics' two halves): a warp a 64-row tile, two rows a lane.
// (a template, so that the four files that include this header may each define it)
template <int kRows = kBwdSpanTileRows>
__global__ void bwd_span_tiles_kernel(const AttentionParams p, int4* tiles) {
  static_assert(kRows == 64, "two rows a lane");
  const int64_t per_head = (p.q_len + kRows - 1) / kRows;
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (t >= p.batch * p.num_heads * per_head) return;  // (whole warps: blockDim is a multiple of 32)
  const int lane = threadIdx.x % 32;
  const int64_t bh = t / per_head, m0 = (t % per_head) * kRows;
  SpanSummary rows;
#pragma unroll
  for (int r = 0; r < 2; ++r) rows.add(key_span(p, bh / p.num_heads, bh % p.num_heads, m0 + lane + 32 * r));
  const SpanSummary tile = rows.over_warp();
  if (lane == 0) tiles[t] = tile.packed();
}

// ---- host launch -------------------------------------------------------------------------------------------------------
template <class Traits>
cudaError_t launch_flash_bwd_hopper(const AttentionBackwardParams& bp, float* stats, float* dq_accum,
                                    bool per_query_head, cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  const int64_t rows = bwd_stats_tasks(p);
  if (rows > 0) {
    if constexpr (Traits::kDeltaVec)
      flash_bwd_delta_vec_kernel<typename Traits::T, Traits::kHeadDim>
          <<<static_cast<unsigned>((rows * (Traits::kHeadDim / 8) + 255) / 256), 256, 0, stream>>>(bp, stats);
    else
      flash_bwd_delta_kernel<typename Traits::T, Traits::kHeadDim>
          <<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, stream>>>(bp, stats);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const unsigned heads = static_cast<unsigned>(p.batch * (per_query_head ? p.num_heads : p.num_kv_heads));
  const unsigned n_blocks = static_cast<unsigned>((p.kv_len + Traits::kBlockN - 1) / Traits::kBlockN);
  if (heads == 0 || n_blocks == 0) return cudaSuccess;  // no keys: dK, dV are empty, dQ stays 0
  const bool packed = p.cu_seqlens_q != nullptr;
  const int mask = has_mask_or_window(p) ? kMaskSpans : p.is_causal ? kMaskCausal : kMaskNone;
  if (mask == kMaskSpans && packed) return cudaErrorNotSupported;
  int4* span_tiles = nullptr;
  if (mask == kMaskSpans) {
    span_tiles = reinterpret_cast<int4*>(stats + 2 * bwd_stats_half(p));
    const int64_t tiles = bwd_span_tiles(p);  // (none without query rows: the blocks then only write dK = dV = 0)
    if (tiles > 0) {
      bwd_span_tiles_kernel<><<<static_cast<unsigned>((tiles * 32 + 255) / 256), 256, 0, stream>>>(p, span_tiles);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
  }
  // [mask][per query head][packed] (key spans: dense calls only)
  decltype(&flash_bwd_hopper_kernel<Traits, kMaskNone, false, false>) const kernels[3][2][2] = {
      {{flash_bwd_hopper_kernel<Traits, kMaskNone, false, false>, flash_bwd_hopper_kernel<Traits, kMaskNone, false, true>},
       {flash_bwd_hopper_kernel<Traits, kMaskNone, true, false>, flash_bwd_hopper_kernel<Traits, kMaskNone, true, true>}},
      {{flash_bwd_hopper_kernel<Traits, kMaskCausal, false, false>,
        flash_bwd_hopper_kernel<Traits, kMaskCausal, false, true>},
       {flash_bwd_hopper_kernel<Traits, kMaskCausal, true, false>,
        flash_bwd_hopper_kernel<Traits, kMaskCausal, true, true>}},
      {{flash_bwd_hopper_kernel<Traits, kMaskSpans, false, false>, nullptr},
       {flash_bwd_hopper_kernel<Traits, kMaskSpans, true, false>, nullptr}}};
  const auto kernel = kernels[mask][per_query_head][packed];
  const int smem_bytes = mask == kMaskSpans ? Traits::kSmemBytesSpans : Traits::kSmemBytes;

  // (packed sequences: maps over the packed rows, one batch; dq_accum is then (heads, total_q, head_dim))
  const MapExtent ext = map_extent(p);
  CUtensorMap tm_q, tm_do, tm_k, tm_v, tm_dq{};
  cudaError_t err = make_head_rows_map(&tm_q, p.dtype, p.q, Traits::kHeadDim, ext.q_rows, p.num_heads, ext.batch,
                                       p.q_strides, Traits::kBlockM);
  if (err == cudaSuccess)
    err = make_head_rows_map(&tm_do, p.dtype, bp.dout, Traits::kHeadDim, ext.q_rows, p.num_heads, ext.batch,
                             bp.dout_strides, Traits::kBlockM);
  if (err == cudaSuccess)
    err = make_head_rows_map(&tm_k, p.dtype, p.k, Traits::kHeadDim, ext.kv_rows, p.num_kv_heads, ext.batch,
                             p.k_strides, Traits::kBlockN);
  if (err == cudaSuccess)
    err = make_head_rows_map(&tm_v, p.dtype, p.v, Traits::kHeadDim, ext.kv_rows, p.num_kv_heads, ext.batch,
                             p.v_strides, Traits::kBlockN);
  if (err == cudaSuccess && Traits::kDqTma)
    err = make_dq_accum_map(&tm_dq, dq_accum, Traits::kHeadDim, ext.q_rows, p.num_heads, ext.batch);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;

  const bool heavy_first = mask == kMaskCausal;
  const dim3 grid = heavy_first ? dim3(heads * n_blocks) : dim3(n_blocks, heads);
  int heads_per_group = 1;
  if (heavy_first) err = group_heads(kernel, Traits::kNThreads, smem_bytes, n_blocks, &heads_per_group);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Traits::kNThreads, smem_bytes, stream>>>(tm_q, tm_do, tm_k, tm_v, tm_dq, bp, stats, span_tiles,
                                                          dq_accum, heads_per_group);
  return cudaGetLastError();
}

}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
