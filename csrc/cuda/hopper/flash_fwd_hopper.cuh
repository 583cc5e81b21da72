// FlashAttention-3's forward on Hopper: the loop of flash_fwd.cuh (the paper's Algorithm 1), warp-specialized.
//
//   producer warpgroup (one thread):   for each work tile: Q_block once its buffer is free;  for each key tile j: wait
//                                      until K's (V's) buffer of its stage is empty, then TMA K_j (V_j) into it,
//                                      completing on its own mbarrier
//   consumer warpgroup w (64 query rows each, 2 or 3 per block):
//     for each key tile j:  wait K_j;   S = Q_w K_jᵀ                                  (wgmma, both from shared memory)
//                           m' = max(m, rowmax S);   P = exp(scale (S − m'))
//                           l = e^{scale(m − m')} l + rowsum P;   O = e^{scale(m − m')} O;   m = m'
//                           wait V_j;   O += P V_j                         (wgmma, P from registers, V transposed)
//                           hand K_j's and V_j's buffers back to the producer as soon as their product is done
//     (the key tiles j past its own rows' last diagonal, or all when its rows are past the end, only handed back)
//     O /= l;   lse = scale·m + log l
//
// As in flash_fwd.cuh, everything is in exp2: the plain and causal kernels fold scale·log2(e) into one multiply-add per
// score; the key-spans kernel first turns S into base-2 logits (scale·log2(e)·S, as flash_mask.cuh's Logits), so its m
// is in those units and lse = ln2·m + log l. Masked keys are −inf, and a row that sees no key writes O = 0 and
// lse = −inf. The consumer warpgroups share the tensor cores:
// while one runs its softmax another's products run. The traits choose the mainloop: serial (the loop above as
// written), overlapped (S_{j+1} and P_j V_j issued together, the softmax of S_{j+1} under P_j V_j) and, on top of it,
// the ping-pong schedule (the warpgroups take turns to issue their products). The plain kernel's grid is persistent,
// a block per SM walking the work tiles (next_tile), so that one tile's epilogue runs under the next tile's loads.
//
// Masking (kMask): none; causal (keys past each row's diagonal); or key spans: attn_mask (through mask_key_bounds' key
// ranges, flash_mask.cuh's key_span), sliding windows and causal together. With spans, the block visits only the key
// tiles some row of it sees, and masks a tile only where it is not inside every row's exact span; there, a key outside
// the row's span is −inf and a row whose mask is not exact reads its entries (boolean: 0 hides; additive: log2(e)·entry
// added to the base-2 logit). The producer warpgroup's 128 threads first find the block's rows' spans, one row each.
//
// Packed sequences (cu_seqlens, the plain and causal kernels): the work tiles are those of the longest sequence for
// every (sequence, head), each reading its sequence's rows through maps over the packed rows; a tile past its
// sequence's end has no key tile. A sequence's last key tile runs into the next sequence's rows: masked as past the
// end, and their V rows zeroed in shared memory before the P V that reads them (clear_v_past).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "../../attention.h"
#include "../flash_common.cuh"
#include "../flash_mask.cuh"
#include "flash_fwd_hopper_launch.h"
#include "kernel_traits.cuh"
#include "packed.cuh"
#include "ptx.cuh"
#include "tensor_map.h"

namespace cs149gpt {
namespace cuda {
namespace hopper {

// The block's shared memory: Q, the (K, V) ring, O's staging buffer (where it has its own) and the mbarriers, from a
// 1024-byte aligned base.
template <class Traits>
struct SharedTiles {
  char* q;  // kPanels panels of kBlockM rows x 128 bytes
  char* k;  // [kStages] tiles of kPanels panels of kBlockN rows x 128 bytes
  char* v;  // the same
  char* o;  // O / l staged for 16-byte stores: its own buffer (as Q) where it fits, else Q's
  uint64_t* q_full;   // Q has arrived
  uint64_t* q_empty;  // every consumer warp is done with Q (and, staged there, with O)
  int* tile;          // the work tile whose Q is (being) loaded; the grid's tile count once there is none left
  uint64_t* k_full;   // [kStages]: K of the stage has arrived
  uint64_t* v_full;   // [kStages]: V of the stage has arrived
  uint64_t* k_empty;  // [kStages]: every consumer warp is done with the stage's K (its S is computed)
  uint64_t* v_empty;  // [kStages]: every consumer warp is done with the stage's V (its P V is computed)

  __device__ explicit SharedTiles(char* base)
      : q(base + Traits::kSmemQ),
        k(base + Traits::kSmemK),
        v(base + Traits::kSmemV),
        o(base + Traits::kSmemO),
        q_full(reinterpret_cast<uint64_t*>(base + Traits::kSmemBarriers)),
        q_empty(q_full + 1),
        tile(reinterpret_cast<int*>(base + Traits::kSmemTile)),
        k_full(q_full + 2),
        v_full(k_full + Traits::kStages),
        k_empty(v_full + Traits::kStages),
        v_empty(k_empty + Traits::kStages) {}
  __device__ char* k_tile(int stage) const { return k + stage * Traits::kKVBytes; }
  __device__ char* v_tile(int stage) const { return v + stage * Traits::kKVBytes; }
};

// The n-th key tile a block loads (counted over all its work tiles, modulo 2³², a multiple of 2·kStages) lives in stage
// n % kStages; its barriers are in their (n / kStages)-th phase.
template <class Traits>
__device__ __forceinline__ int stage_of(uint32_t n) {
  static_assert((Traits::kStages & (Traits::kStages - 1)) == 0, "the count may wrap");
  return static_cast<int>(n % Traits::kStages);
}
template <class Traits>
__device__ __forceinline__ uint32_t phase_of(uint32_t n) { return (n / Traits::kStages) & 1; }

// A consumer warp hands a buffer back: lane 0 arrives once the warp's products that read it have completed.
__device__ __forceinline__ void release(uint64_t* empty, int lane) {
  if (lane == 0) mbarrier_arrive(empty);
}

// A work tile: kBlockM query rows of one (batch, head), and the key tiles n_first .. n_first + n_tiles − 1 some row of
// it sees; its sequence's lengths and causal offset (the call's, or with packed sequences, sequence b's), and where
// the sequence's rows start in q, out, lse (q_row0) and k, v (k_row0) of batch bm (packed: 0, the rows of one batch).
struct WorkTile {
  int b, h, hk, bm;
  int64_t m0;
  int n_first, n_tiles;
  int64_t q_len, kv_len, causal_offset, q_row0, k_row0;
};

// ---- the producer -----------------------------------------------------------------------------------------------------
// One thread. A work tile's Q, once the consumers are done with the previous tile's (the caller has waited).
template <class Traits>
__device__ __forceinline__ void load_q(const SharedTiles<Traits>& sm, const CUtensorMap* tm_q, const WorkTile& w) {
  mbarrier_arrive_expect_tx(sm.q_full, Traits::kQBytes);
  const int row = static_cast<int>(w.q_row0 + w.m0);
#pragma unroll
  for (int panel = 0; panel < Traits::kPanels; ++panel)
    tma_load_4d(sm.q + panel * Traits::kQPanelBytes, tm_q, sm.q_full, panel * Traits::kPanelCols, row, w.h, w.bm);
}

// K and V of the work tile's key tile n0 / kBlockN, the ring's tile g, each panel (64 columns of head_dim) one TMA
// box, each into its stage's buffer once the consumers have released it. A paged cache: the tile is rows n0 % page_size
// on of page block_table[b, n0 / page_size] (a page holds whole tiles: hopper_takes_shapes).
template <class Traits>
__device__ __forceinline__ void load_kv(const SharedTiles<Traits>& sm, const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                        const AttentionParams& p, const WorkTile& w, int n0, uint32_t g) {
  int row = static_cast<int>(w.k_row0 + n0);
  if (p.block_table != nullptr) {
    const int page_size = static_cast<int>(p.page_size), page = n0 / page_size;
    row = p.block_table[w.b * p.block_table_stride + page] * page_size + (n0 - page * page_size);
  }
  const int hk = w.hk, b = w.bm;
  const int stage = stage_of<Traits>(g);
  const uint32_t released = phase_of<Traits>(g) ^ 1;  // the phase in which tile g − kStages was released
  mbarrier_wait(&sm.k_empty[stage], released);
  mbarrier_arrive_expect_tx(&sm.k_full[stage], Traits::kKVBytes);
#pragma unroll
  for (int panel = 0; panel < Traits::kPanels; ++panel)
    tma_load_4d(sm.k_tile(stage) + panel * Traits::kKVPanelBytes, tm_k, &sm.k_full[stage], panel * Traits::kPanelCols,
                row, hk, b);
  mbarrier_wait(&sm.v_empty[stage], released);
  mbarrier_arrive_expect_tx(&sm.v_full[stage], Traits::kKVBytes);
#pragma unroll
  for (int panel = 0; panel < Traits::kPanels; ++panel)
    tma_load_4d(sm.v_tile(stage) + panel * Traits::kKVPanelBytes, tm_v, &sm.v_full[stage], panel * Traits::kPanelCols,
                row, hk, b);
}

// ---- the consumers' products ------------------------------------------------------------------------------------------
// S = Q_w K_jᵀ (64 x kBlockN): head_dim / 16 k-steps, step kk 16 columns of head_dim, i.e. 32·(kk % 4) bytes into the
// rows of panel kk / 4 of both Q_w and K_j (K-major operands, 1024 bytes between 8-row atoms). Issued, not waited.
template <class Traits>
__device__ __forceinline__ void gemm_qk(float (&s)[Traits::kBlockN / 2], const char* q_w, const char* k_j) {
  const uint64_t desc_q = smem_desc_sw128(q_w, 16, 1024), desc_k = smem_desc_sw128(k_j, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk) {
    const int panel = kk / 4, bytes = (kk % 4) * 32;
    wgmma_ss<Traits::kBlockN, typename Traits::T>(s, desc_advance(desc_q, panel * Traits::kQPanelBytes + bytes),
                                                  desc_advance(desc_k, panel * Traits::kKVPanelBytes + bytes), kk > 0);
  }
  wgmma_commit();
}

// O += P V_j (64 x head_dim): kBlockN / 16 k-steps, step kk the keys 16·kk .. 16·kk + 15, i.e. 2048·kk bytes into
// every panel of V_j; V is MN-major (head_dim along its 128-byte rows): 1024 bytes between 8-key atoms, a panel's
// bytes between the 64-column blocks of head_dim. Issued, not waited.
template <class Traits>
__device__ __forceinline__ void gemm_pv(float (&o)[Traits::kHeadDim / 2], const uint32_t (&p)[Traits::kBlockN / 16][4],
                                        const char* v_j) {
  const uint64_t desc_v = smem_desc_sw128(v_j, Traits::kKVPanelBytes, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk)
    wgmma_rs<Traits::kHeadDim, typename Traits::T>(o, p[kk], desc_advance(desc_v, kk * 16 * Traits::kRowBytes), 1);
  wgmma_commit();
}

// ---- the consumers' softmax, on the accumulator fragment (ptx.cuh) -----------------------------------------------------
// Each thread holds two rows of its warp's 16: r = 0 (row g) in s[4j], s[4j+1], r = 1 (row g + 8) in s[4j+2], s[4j+3],
// at key columns 8j + 2t, 8j + 2t + 1 (g = lane / 4, t = lane % 4); a row's 4 threads are a quad.

// Keys past the end (kv_len), and under the causal mask past each row's diagonal, become −inf. row0: the query index
// of the thread's row g; n0: the tile's first key. Each of the thread's two rows sees the tile's keys below a bound,
// counted from the thread's first key n0 + 2·(lane % 4): one 32-bit compare with a constant a score.
template <class Traits, bool kIsCausal>
__device__ __forceinline__ void mask_scores(float (&s)[Traits::kBlockN / 2], int64_t kv_len, int64_t causal_offset,
                                            int64_t row0, int64_t n0, int lane) {
  const int64_t first = n0 + (lane % 4) * 2;
  const auto clamp = [](int64_t x) { return static_cast<int>(min64(max64(x, 0), Traits::kBlockN)); };
  int bound[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t end = kIsCausal ? min64(kv_len, row0 + 8 * r + causal_offset + 1) : kv_len;
    bound[r] = clamp(end - first);
  }
#pragma unroll
  for (int j = 0; j < Traits::kBlockN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (!(j * 8 + e % 2 < bound[e / 2])) s[4 * j + e] = -INFINITY;
}

// A consumer thread's two rows under key spans (flash_mask.cuh's key_span), and the (batch, head) whose attn_mask rows
// it reads where a row's span is not exact.
struct RowSpans {
  KeySpan span[2];
  int b, h;
};

// Key spans on a tile that is not inside every row's exact span, its scores already base-2 logits (scale · log2(e) · s):
// keys outside the row's span become −inf (set, never added to: a NaN in such a key's k never reaches the row);
// inside, a row whose span is not exact reads its entries (boolean: 0 hides the key; additive: log2(e) · entry added,
// as flash_mask.cuh's Logits: −inf hides the key, +inf and NaN make the row NaN).
template <class Traits>
__device__ __forceinline__ void mask_scores_spans(float (&s)[Traits::kBlockN / 2], const AttentionParams& p,
                                                  const RowSpans& rs, int64_t row0, int64_t n0, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const KeySpan& span = rs.span[r];
    const char* entries = nullptr;  // the row's attn_mask entries, read only where its span is not exact
    int64_t key_bytes = 0;
    if (!span.exact) {
      const Logits logits(p, rs.b, rs.h);
      entries = logits.mask + (row0 + 8 * r) * logits.mask_row;
      key_bytes = logits.mask_key;
    }
#pragma unroll
    for (int j = 0; j < Traits::kBlockN / 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int64_t key = n0 + j * 8 + (lane % 4) * 2 + c;
        float& x = s[4 * j + 2 * r + c];
        if (key < span.lo || key >= span.hi) x = -INFINITY;
        else if (!span.exact) x = with_mask_entry_at(p, x, entries + key * key_bytes);
      }
  }
}

// m' = max(m, rowmax S);  P = 2^(c (S − m'));  alpha = 2^(c (m − m'));  l = alpha l + rowsum P, with c = scale_log2
// (scale·log2(e) on raw scores; 1 under key spans, whose S is already base-2 logits). In place: S becomes P. m is in S's
// units; a row that has seen no key keeps m = −inf and P = 0, no NaN. l is this thread's part of its row's sum; the
// quad's four parts are added once, at the end.
template <class Traits>
__device__ __forceinline__ void online_softmax(float (&s)[Traits::kBlockN / 2], float (&m)[2], float (&l)[2],
                                               float (&alpha)[2], float scale_log2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float row_max = m[r];
#pragma unroll
    for (int j = 0; j < Traits::kBlockN / 8; ++j) row_max = fmaxf(row_max, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    row_max = quad_max(row_max);
    const float shift = row_max == -INFINITY ? 0.f : row_max * scale_log2;  // 0 while the row has seen nothing
    alpha[r] = exp2_approx(m[r] * scale_log2 - shift);                       // 0 when m = −inf, 1 when the max stays
    m[r] = row_max;
    float row_sum = 0.f;
#pragma unroll
    for (int j = 0; j < Traits::kBlockN / 8; ++j) {
      s[4 * j + 2 * r] = exp2_approx(fmaf(s[4 * j + 2 * r], scale_log2, -shift));
      s[4 * j + 2 * r + 1] = exp2_approx(fmaf(s[4 * j + 2 * r + 1], scale_log2, -shift));
      row_sum += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
    }
    l[r] = l[r] * alpha[r] + row_sum;
  }
}

// O *= alpha, row by row (O's fragment is laid out as S's, with head_dim columns).
template <class Traits>
__device__ __forceinline__ void rescale_o(float (&o)[Traits::kHeadDim / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < Traits::kHeadDim / 8; ++j) {
    o[4 * j] *= alpha[0];
    o[4 * j + 1] *= alpha[0];
    o[4 * j + 2] *= alpha[1];
    o[4 * j + 3] *= alpha[1];
  }
}

// P in T, as the A operand of P V: k-slice kk (keys 16kk .. 16kk + 15) is s[8kk .. 8kk + 7], two at a time.
template <class Traits>
__device__ __forceinline__ void scores_to_a_frags(uint32_t (&a)[Traits::kBlockN / 16][4],
                                                  const float (&s)[Traits::kBlockN / 2]) {
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[kk][r] = pack2<typename Traits::T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

// ---- the consumers' mainloops --------------------------------------------------------------------------------------------
// A consumer thread's place: its rows and the softmax's constant; under key spans, its rows' spans and the key range
// [full_lo, full_hi) where every row of its warpgroup sees every key exactly (tiles inside it need no mask).
struct ConsumerRows {
  int wg;             // the consumer warpgroup, 0 .. kConsumerWarpgroups − 1
  int64_t row0;       // query index of the thread's row g (its other row is row0 + 8)
  int64_t wg_first;   // the warpgroup's first query row
  int lane;
  float scale_log2;   // scale · log2(e): the softmax's factor on raw scores (key spans: 1, the scores pre-scaled)
  int n_first;        // the work tile's first key tile (key spans; else 0)
  uint32_t kv;        // the ring position of the work tile's first key tile
  int64_t kv_len, causal_offset;  // the work tile's sequence's
  int64_t v_tail;     // packed sequences: the first key whose V rows hold the next sequence's (clear_v_past); else max
  RowSpans spans;     // (key spans only)
  int full_lo, full_hi;
};

// The softmax of the block's n-th key tile's scores S (in place, S becomes P): masked only where the tile crosses the
// end of the keys or some row's diagonal (key spans: where it is not inside every row's exact span), then the online
// step; alpha is the factor O must be rescaled by.
template <class Traits, int kMask>
__device__ __forceinline__ void softmax_step(float (&s)[Traits::kBlockN / 2], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], const AttentionParams& p, const ConsumerRows& rows,
                                             int n) {
  const int64_t n0 = static_cast<int64_t>(rows.n_first + n) * Traits::kBlockN;
  if constexpr (kMask == kMaskSpans) {
    // Base-2 logits first, as the general FA2 kernel has them: an additive entry then adds to them in their units (a
    // huge finite one, −1e38, stays finite and the softmax's shift cancels it exactly).
    const float c = p.scale * kLog2e;
#pragma unroll
    for (int i = 0; i < Traits::kBlockN / 2; ++i) s[i] *= c;
    if (!(n0 >= rows.full_lo && n0 + Traits::kBlockN <= rows.full_hi))
      mask_scores_spans<Traits>(s, p, rows.spans, rows.row0, n0, rows.lane);
  } else {
    constexpr bool kIsCausal = kMask == kMaskCausal;
    const bool needs_mask = n0 + Traits::kBlockN > rows.kv_len ||
                            (kIsCausal && n0 + Traits::kBlockN - 1 > rows.wg_first + rows.causal_offset);
    if (needs_mask) mask_scores<Traits, kIsCausal>(s, rows.kv_len, rows.causal_offset, rows.row0, n0, rows.lane);
  }
  online_softmax<Traits>(s, m, l, alpha, rows.scale_log2);
}

// Named barriers (ids; 0 is __syncthreads'): the epilogue's, one per consumer warpgroup, and the ping-pong's turns.
constexpr int kEpilogueBarrier = 1;  // + warpgroup (at most 3)
constexpr int kTurnBarrier = 4;      // + warpgroup

// Packed sequences: a key tile that runs past its sequence's keys holds the next sequence's rows there (only the
// tensor's end reads as zeros). Their P is 0, but 0 · inf is NaN: before its P V reads V_j, a warpgroup zeroes those
// rows (every warpgroup writes the same zeros). n0: the tile's first key; from: ConsumerRows::v_tail.
template <class Traits>
__device__ __forceinline__ void clear_v_past(char* v_j, int64_t n0, int64_t from, int wg) {
  if (n0 + Traits::kBlockN <= from) return;
  zero_rows<Traits::kPanels>(v_j, Traits::kKVPanelBytes, static_cast<int>(max64(0, from - n0)), Traits::kBlockN,
                             threadIdx.x % 128, 128);
  fence_proxy_async();                             // the tensor cores read them after
  named_barrier_sync(kEpilogueBarrier + wg, 128);  // every warp's rows
}

// The ping-pong schedule (Traits::kPingPong): a consumer warpgroup issues its products only in its turn (it waits on
// barrier kTurnBarrier + its index) and hands the turn to the next (w + 1, the last back to 0) once they are issued, so
// that its softmax runs while the others' products occupy the tensor cores. Warpgroup 0 starts (the last warpgroup
// arrives on its barrier first). Each warpgroup takes the turn once per issue point and hands it over as often, except
// the last one after its last (warpgroup 0 waits no more): every barrier phase that is started completes.
template <class Traits>
struct IssueTurns {
  static constexpr int kLast = Traits::kConsumerWarpgroups - 1;
  int wg, issue_points, issued = 0;
  __device__ IssueTurns(int wg_, int issue_points_) : wg(wg_), issue_points(issue_points_) {
    if (Traits::kPingPong && wg == kLast) named_barrier_arrive(kTurnBarrier + 0, 256);
  }
  __device__ void take() {
    if (Traits::kPingPong) named_barrier_sync(kTurnBarrier + wg, 256);
  }
  __device__ void hand_over() {
    if (Traits::kPingPong && !(wg == kLast && ++issued == issue_points))
      named_barrier_arrive(kTurnBarrier + (wg == kLast ? 0 : wg + 1), 256);
  }
};

// The block's key tiles past the warpgroup's own (n_own .. n_tiles − 1, which none of its rows sees): each handed back
// once it has arrived (so that the arrivals count in their own phase), and under the ping-pong schedule one turn each,
// taken and passed on at once (every warpgroup takes the turn the same n_tiles + 1 times).
template <class Traits>
__device__ __forceinline__ void skip_tiles(const SharedTiles<Traits>& sm, const ConsumerRows& rows, int n_own,
                                           int n_tiles, IssueTurns<Traits>* turns) {
  for (int n = n_own; n < n_tiles; ++n) {
    const uint32_t g = rows.kv + n;
    const int stage = stage_of<Traits>(g);
    mbarrier_wait(&sm.k_full[stage], phase_of<Traits>(g));
    release(&sm.k_empty[stage], rows.lane);
    mbarrier_wait(&sm.v_full[stage], phase_of<Traits>(g));
    release(&sm.v_empty[stage], rows.lane);
    if (turns != nullptr) {
      turns->take();
      turns->hand_over();
    }
  }
}

// One key tile after another: S = Q K_jᵀ, its softmax, O += P V_j, each product waited for before the next step.
template <class Traits, int kMask>
__device__ __forceinline__ void mainloop_serial(const SharedTiles<Traits>& sm, const char* q_w, const AttentionParams& p,
                                                const ConsumerRows& rows, int n_own, int n_tiles,
                                                float (&o)[Traits::kHeadDim / 2], float (&m)[2], float (&l)[2]) {
  float s[Traits::kBlockN / 2];
#pragma unroll
  for (int i = 0; i < Traits::kBlockN / 2; ++i) s[i] = 0.f;
  uint32_t p_frag[Traits::kBlockN / 16][4];
  for (int n = 0; n < n_own; ++n) {
    const int stage = stage_of<Traits>(rows.kv + n);
    const uint32_t phase = phase_of<Traits>(rows.kv + n);

    mbarrier_wait(&sm.k_full[stage], phase);
    gemm_qk<Traits>(s, q_w, sm.k_tile(stage));  // S = Q K_jᵀ
    wgmma_wait<0>();
    fence_fragment(s);
    release(&sm.k_empty[stage], rows.lane);

    float alpha[2];
    softmax_step<Traits, kMask>(s, m, l, alpha, p, rows, n);
    rescale_o<Traits>(o, alpha);
    scores_to_a_frags<Traits>(p_frag, s);

    mbarrier_wait(&sm.v_full[stage], phase);
    if (n == n_tiles - 1)
      clear_v_past<Traits>(sm.v_tile(stage), static_cast<int64_t>(rows.n_first + n) * Traits::kBlockN, rows.v_tail,
                           rows.wg);
    gemm_pv<Traits>(o, p_frag, sm.v_tile(stage));  // O += P V_j
    wgmma_wait<0>();
    fence_fragment(o);
    fence_fragment(p_frag);
    release(&sm.v_empty[stage], rows.lane);
  }
  skip_tiles<Traits>(sm, rows, n_own, n_tiles, nullptr);
}

// FlashAttention-3's intra-warpgroup overlap: S_j = Q K_jᵀ and O += P_{j−1} V_{j−1} are issued together; once S_j is
// done its softmax runs while P_{j−1} V_{j−1} is still on the tensor cores. O is rescaled by tile j's alpha after that
// product: e^{scale(m_{j−1} − m_j)} (O + P_{j−1} V_{j−1}), both terms being relative to m_{j−1}.
template <class Traits, int kMask>
__device__ __forceinline__ void mainloop_overlapped(const SharedTiles<Traits>& sm, const char* q_w,
                                                    const AttentionParams& p, const ConsumerRows& rows, int n_own,
                                                    int n_tiles, float (&o)[Traits::kHeadDim / 2], float (&m)[2],
                                                    float (&l)[2]) {
  float s[Traits::kBlockN / 2];
#pragma unroll
  for (int i = 0; i < Traits::kBlockN / 2; ++i) s[i] = 0.f;
  uint32_t p_frag[Traits::kBlockN / 16][4];
  float alpha[2];

  // n_tiles + 1 issue points: S_0; then S_j with P_{j−1} V_{j−1}; then the last P V; then one per skipped tile (with
  // n_own = 0: S_0's point, empty, and one per tile).
  IssueTurns<Traits> turns(rows.wg, n_tiles + 1);
  if (n_own == 0) {  // (S_0's turn, with nothing to issue)
    turns.take();
    turns.hand_over();
    skip_tiles<Traits>(sm, rows, 0, n_tiles, &turns);
    return;
  }

  // Tile 0: S_0 and its softmax alone (O is still 0: nothing to rescale).
  const int first = stage_of<Traits>(rows.kv);
  mbarrier_wait(&sm.k_full[first], phase_of<Traits>(rows.kv));
  turns.take();
  gemm_qk<Traits>(s, q_w, sm.k_tile(first));
  turns.hand_over();
  wgmma_wait<0>();
  fence_fragment(s);
  release(&sm.k_empty[first], rows.lane);
  softmax_step<Traits, kMask>(s, m, l, alpha, p, rows, 0);
  scores_to_a_frags<Traits>(p_frag, s);

  for (int n = 1; n < n_own; ++n) {
    const uint32_t g = rows.kv + n;  // the ring's count
    const int stage = stage_of<Traits>(g), prev = stage_of<Traits>(g - 1);
    mbarrier_wait(&sm.k_full[stage], phase_of<Traits>(g));
    mbarrier_wait(&sm.v_full[prev], phase_of<Traits>(g - 1));
    turns.take();
    gemm_qk<Traits>(s, q_w, sm.k_tile(stage));    // S_j = Q K_jᵀ ...
    gemm_pv<Traits>(o, p_frag, sm.v_tile(prev));  // ... and O += P_{j−1} V_{j−1}, both in flight
    turns.hand_over();
    wgmma_wait<1>();                               // S_j is done (groups complete in order)
    fence_fragment(s);
    release(&sm.k_empty[stage], rows.lane);
    softmax_step<Traits, kMask>(s, m, l, alpha, p, rows, n);  // under P_{j−1} V_{j−1}
    wgmma_wait<0>();
    fence_fragment(o);
    fence_fragment(p_frag);
    release(&sm.v_empty[prev], rows.lane);
    rescale_o<Traits>(o, alpha);
    scores_to_a_frags<Traits>(p_frag, s);
  }

  // The last tile's O += P V (the only one that can run past the sequence's keys: that is the work tile's last).
  const int last = stage_of<Traits>(rows.kv + n_own - 1);
  mbarrier_wait(&sm.v_full[last], phase_of<Traits>(rows.kv + n_own - 1));
  clear_v_past<Traits>(sm.v_tile(last), static_cast<int64_t>(rows.n_first + n_own - 1) * Traits::kBlockN, rows.v_tail,
                       rows.wg);
  turns.take();
  gemm_pv<Traits>(o, p_frag, sm.v_tile(last));
  turns.hand_over();
  wgmma_wait<0>();
  fence_fragment(o);
  fence_fragment(p_frag);
  release(&sm.v_empty[last], rows.lane);
  skip_tiles<Traits>(sm, rows, n_own, n_tiles, &turns);
}

// ---- the consumers' epilogue ------------------------------------------------------------------------------------------
// O / l in T, staged through the warpgroup's own 64 rows of the staging tile (sm.o: its own buffer, or Q's, which no
// wgmma reads any more) so that global memory is written in whole 16-byte row chunks; lse = m_to_natural·m + log l
// (−inf, and O = 0, for a row that saw no key); m_to_natural: scale for m in raw scores, ln 2 for m in base-2 logits
// (key spans).
// The staging uses the 128-byte swizzle's pattern (chunk c of row r at c ^ (r % 8)): a quad's 4-byte writes then hit
// 32 different banks.
template <class Traits>
__device__ __forceinline__ void write_out_lse(const float (&o)[Traits::kHeadDim / 2], const float (&m)[2],
                                              const float (&l)[2], const AttentionParams& p, char* o_tile, int wg,
                                              const WorkTile& w, float m_to_natural) {
  using T = typename Traits::T;
  constexpr int kD = Traits::kHeadDim;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  float row_l[2], inv_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_l[r] = quad_sum(l[r]);
    inv_l[r] = row_l[r] == 0.f ? 0.f : 1.f / row_l[r];  // a NaN l (a NaN or +inf logit) makes the row NaN
  }
  char* rows = o_tile + wg * 64 * Traits::kRowBytes;  // this warpgroup's 64 rows, in every panel
  const auto staged = [&](int row, int col) {          // byte address of (row, col), col a multiple of 2
    return rows + (col / Traits::kPanelCols) * Traits::kQPanelBytes + row * Traits::kRowBytes +
           ((((col % Traits::kPanelCols) / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
  };

  if (!Traits::kOwnOBuffer) fence_proxy_async();   // the tensor cores' reads of Q come before these writes
  // Every warp of the warpgroup is past its last wgmma (and past its reads of the previous tile's staged rows).
  named_barrier_sync(kEpilogueBarrier + wg, 128);
#pragma unroll
  for (int j = 0; j < kD / 8; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + lane / 4 + 8 * r, col = 8 * j + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(staged(row, col)) =
          pack2<T>(o[4 * j + 2 * r] * inv_l[r], o[4 * j + 2 * r + 1] * inv_l[r]);
    }
  named_barrier_sync(kEpilogueBarrier + wg, 128);  // the staged rows are complete

  constexpr int kChunksPerRow = kD / 8;  // 16-byte chunks
  constexpr int kRowsPerPass = 128 / kChunksPerRow;
  const int chunk = tid % kChunksPerRow;
  T* out = static_cast<T*>(p.out) + w.bm * p.out_strides[0] + w.h * p.out_strides[1] + w.q_row0 * p.out_strides[2];
#pragma unroll
  for (int row = tid / kChunksPerRow; row < 64; row += kRowsPerPass) {
    const int64_t q_row = w.m0 + wg * 64 + row;
    if (q_row < w.q_len)
      *reinterpret_cast<uint4*>(out + q_row * p.out_strides[2] + chunk * 8) =
          *reinterpret_cast<const uint4*>(staged(row, chunk * 8));
  }

  if (p.lse != nullptr && lane % 4 == 0)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t q_row = w.m0 + wg * 64 + warp * 16 + lane / 4 + 8 * r;
      if (q_row < w.q_len)
        p.lse[w.bm * p.lse_strides[0] + w.h * p.lse_strides[1] + w.q_row0 + q_row] =
            row_l[r] == 0.f ? -INFINITY : m[r] * m_to_natural + logf(row_l[r]);
    }
}

// ---- the kernel -------------------------------------------------------------------------------------------------------
// The order of the work tiles, as flash_fwd.cuh's blocks: without a mask, query tiles within a (batch, head); causal,
// grouped_heavy_first's (a head's last query tile is its costliest); key spans, the query tiles last first (under a
// causal or padded-causal mask, the costliest first; under others the order does not matter). Its rows only.
template <int kMask>
__device__ __forceinline__ WorkTile tile_rows(const AttentionParams& p, int tile, int m_blocks, int heads_per_group,
                                              int block_m) {
  int m_block, bh;
  if constexpr (kMask == kMaskCausal) {
    const HeadTile ht = grouped_heavy_first(tile, static_cast<int>(p.batch * p.num_heads), m_blocks, heads_per_group);
    m_block = m_blocks - 1 - ht.tile_rank;
    bh = ht.head;
  } else {
    m_block = kMask == kMaskSpans ? m_blocks - 1 - tile % m_blocks : tile % m_blocks;
    bh = tile / m_blocks;
  }
  WorkTile w;
  w.b = bh / static_cast<int>(p.num_heads);
  w.h = bh % static_cast<int>(p.num_heads);
  w.hk = w.h / static_cast<int>(p.num_heads / p.num_kv_heads);
  w.m0 = static_cast<int64_t>(m_block) * block_m;
  w.n_first = w.n_tiles = 0;
  // Packed sequences: sequence b's rows of the one batch, its lengths and offset as sequence_view (attention.h) has
  // them, without copying the params (packed.cuh's sequence_rows in 64 bits: its 32-bit fields change this kernel's
  // code, dense calls' included).
  if (kMask != kMaskSpans && p.cu_seqlens_q != nullptr) {
    w.bm = 0;
    w.q_row0 = p.cu_seqlens_q[w.b];
    w.k_row0 = p.cu_seqlens_k[w.b];
    w.q_len = p.cu_seqlens_q[w.b + 1] - w.q_row0;
    w.kv_len = p.cu_seqlens_k[w.b + 1] - w.k_row0;
    w.causal_offset = w.kv_len - w.q_len;  // bottom-right in the sequence
    if (p.block_table != nullptr) w.k_row0 = 0;  // a paged cache: its keys' rows through the table (load_kv)
  } else {
    w.bm = w.b;
    w.q_row0 = w.k_row0 = 0;
    w.q_len = p.q_len;
    w.kv_len = p.kv_len;
    w.causal_offset = p.causal_offset;
  }
  return w;
}

// The work tile and its key tiles. span_bounds: the key spans kernel's (first, end) over the rows of its block's tile.
template <class Traits, int kMask>
__device__ __forceinline__ WorkTile work_tile(const AttentionParams& p, int tile, int m_blocks, int heads_per_group,
                                              const int* span_bounds) {
  WorkTile w = tile_rows<kMask>(p, tile, m_blocks, heads_per_group, Traits::kBlockM);
  int64_t n_end = w.m0 < w.q_len ? w.kv_len : 0;  // (packed: the query tiles past a sequence's end have no keys)
  if constexpr (kMask == kMaskCausal) n_end = max64(0, min64(n_end, w.m0 + Traits::kBlockM + w.causal_offset));
  if constexpr (kMask == kMaskSpans) {
    w.n_first = span_bounds[1] > span_bounds[0] ? span_bounds[0] / Traits::kBlockN : 0;
    n_end = span_bounds[1] > span_bounds[0] ? span_bounds[1] : 0;
  }
  w.n_tiles = static_cast<int>(max64(0, (n_end + Traits::kBlockN - 1) / Traits::kBlockN - w.n_first));
  return w;
}

// How many of the work tile's key tiles (a prefix) some row of the warpgroup from wg_first sees. Under key spans, all
// of them; else none when its rows are past the query rows; under the causal mask, those up to its last row's
// diagonal (at Br 192 the first warpgroup's rows end 128 before the block's: at N 2048 a tenth of the products the
// block would run is skipped); else all.
template <class Traits, int kMask>
__device__ __forceinline__ int own_key_tiles(const WorkTile& w, int64_t wg_first) {
  if constexpr (kMask == kMaskSpans) return w.n_tiles;
  if (wg_first >= w.q_len) return 0;
  if constexpr (kMask == kMaskCausal) {
    const int64_t n_end = max64(0, min64(w.kv_len, wg_first + 64 + w.causal_offset));
    return static_cast<int>(min64(w.n_tiles, (n_end + Traits::kBlockN - 1) / Traits::kBlockN));
  }
  return w.n_tiles;
}

// Key spans: the union of the spans of the rows of query tile m0, and for each consumer warpgroup the keys
// [full_lo, full_hi) every one of its rows sees exactly (empty if a row is not exact), found by the producer
// warpgroup's 128 threads, one row each; the whole block takes part.
template <class Traits>
__device__ __forceinline__ void find_span_bounds(const AttentionParams& p, int b, int h, int64_t m0, int* span_bounds) {
  static_assert(Traits::kBlockM == 128, "one producer thread per row of the block");
  if (threadIdx.x < 2 + 2 * Traits::kConsumerWarpgroups)
    span_bounds[threadIdx.x] = threadIdx.x == 0 ? INT_MAX : threadIdx.x == 1 ? 0 : threadIdx.x % 2 ? INT_MAX : 0;
  __syncthreads();
  if (threadIdx.x < Traits::kBlockM) {
    SpanSummary rows;
    rows.add(key_span(p, b, h, m0 + threadIdx.x));
    const SpanSummary warp = rows.over_warp();
    if (threadIdx.x % 32 == 0) {
      const int wg = threadIdx.x / 64;
      atomicMin(&span_bounds[0], warp.first);
      atomicMax(&span_bounds[1], warp.end);
      atomicMax(&span_bounds[2 + 2 * wg], warp.full_lo);
      atomicMin(&span_bounds[3 + 2 * wg], warp.full_hi);
    }
  }
  __syncthreads();
}

// The schedule of the work tiles. Persistent grids (a block per SM) run tile after tile, the producer loading the next
// tile's first key tile and Q while the consumers finish this one, the ring's stages and phases running on across
// tiles. Given a tile counter, the plain and causal kernels schedule dynamically: each block's first tile is
// blockIdx.x, then the producer takes the next (of the heavy-first order, under the causal mask) from the counter as
// it finishes loading a tile, so that tiles of unequal cost, and blocks that start late (an SM busy with another
// stream's kernel), balance as under the hardware's block scheduler; a static persistent causal grid, even with every
// other round mirrored, measured 0.75-0.93x a block per tile at N >= 8192. Without a counter the plain kernel walks
// blockIdx.x, blockIdx.x + gridDim.x, ... statically, the causal one has a block per tile; key spans always do.
// Tile i of block `block` of `blocks`; INT_MAX: none (dynamic: gridDim.x and up, compared with the grid's tile count
// by the caller).
template <int kMask>
__device__ __forceinline__ int next_tile(int i, int block, int blocks, int* tile_counter) {
  if (i == 0) return block;
  if (kMask != kMaskSpans && tile_counter != nullptr) return blocks + atomicAdd(tile_counter, 1);
  if (kMask != kMaskNone) return INT_MAX;
  return i * blocks + block;
}

template <class Traits, int kMask>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_hopper_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                            const __grid_constant__ CUtensorMap tm_v, const AttentionParams p, int heads_per_group,
                            int* tile_counter) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kD = Traits::kHeadDim;
  // Dynamic: the consumers learn each tile from the producer (sm.tile), the grid's tile count meaning none is left.
  const bool dynamic = kMask != kMaskSpans && tile_counter != nullptr;
  extern __shared__ char smem_raw[];
  char* base = smem_raw + (1024 - smem_u32(smem_raw) % 1024) % 1024;  // the 128-byte swizzle's atoms are 1024-aligned
  const SharedTiles<Traits> sm(base);
  const int m_blocks = static_cast<int>((p.q_len + Traits::kBlockM - 1) / Traits::kBlockM);
  const int tiles = m_blocks * static_cast<int>(p.batch * p.num_heads);

  __shared__ int span_bounds[2 + 2 * Traits::kConsumerWarpgroups];  // first, end; (full_lo, full_hi) per warpgroup
  if constexpr (kMask == kMaskSpans) {
    const WorkTile w = tile_rows<kMaskSpans>(p, static_cast<int>(blockIdx.x), m_blocks, 0, Traits::kBlockM);
    find_span_bounds<Traits>(p, w.b, w.h, w.m0, span_bounds);
  }

  if (threadIdx.x == 0) {
    mbarrier_init(sm.q_full, 1);
    mbarrier_init(sm.q_empty, 4 * Traits::kConsumerWarpgroups);  // lane 0 of every consumer warp
#pragma unroll
    for (int s = 0; s < Traits::kStages; ++s) {
      mbarrier_init(&sm.k_full[s], 1);
      mbarrier_init(&sm.v_full[s], 1);
      mbarrier_init(&sm.k_empty[s], 4 * Traits::kConsumerWarpgroups);
      mbarrier_init(&sm.v_empty[s], 4 * Traits::kConsumerWarpgroups);
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
    if (threadIdx.x == 0) {
      prefetch_tensor_map(&tm_q);
      prefetch_tensor_map(&tm_k);
      prefetch_tensor_map(&tm_v);
      uint32_t kv = 0;  // key tiles loaded so far: the ring's position
      for (int i = 0, tile = blockIdx.x;; ++i) {
        if (tile >= tiles && !dynamic) break;
        WorkTile w{};
        if (tile < tiles) w = work_tile<Traits, kMask>(p, tile, m_blocks, heads_per_group, span_bounds);
        // The tile's first K and V go ahead of its Q: their buffers free up while the previous tile is computed, Q's
        // only once it is done.
        if (w.n_tiles > 0) load_kv<Traits>(sm, &tm_k, &tm_v, p, w, w.n_first * Traits::kBlockN, kv);
        mbarrier_wait(sm.q_empty, static_cast<uint32_t>(i & 1) ^ 1);  // Q is free (the first tile's wait returns at once)
        if (dynamic) *sm.tile = min(tile, tiles);  // (published by the arrival on q_full below)
        if (tile >= tiles) {
          mbarrier_arrive(sm.q_full);  // none left: the consumers read it and stop
          break;
        }
        if (w.n_tiles > 0) load_q<Traits>(sm, &tm_q, w);
        else mbarrier_arrive(sm.q_full);  // no S reads Q (a sequence's rows past the keys, or past its end)
        for (int n = 1; n < w.n_tiles; ++n)
          load_kv<Traits>(sm, &tm_k, &tm_v, p, w, (w.n_first + n) * Traits::kBlockN, kv + n);
        kv += static_cast<uint32_t>(w.n_tiles);
        tile = next_tile<kMask>(i + 1, blockIdx.x, gridDim.x, tile_counter);
      }
    }
  } else {
    // ---- consumers ----
    setmaxnreg_inc<Traits::kConsumerRegs>();
    const int wg = warpgroup - 1;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const char* q_w = sm.q + wg * 64 * Traits::kRowBytes;  // the warpgroup's 64 rows of every Q panel
    uint32_t kv = 0;
    for (int i = 0, tile = blockIdx.x; tile < tiles; ++i) {
      mbarrier_wait(sm.q_full, static_cast<uint32_t>(i & 1));
      if (dynamic) tile = *static_cast<volatile int*>(sm.tile);
      if (tile >= tiles) break;
      const WorkTile w = work_tile<Traits, kMask>(p, tile, m_blocks, heads_per_group, span_bounds);
      const int64_t row0 = w.m0 + wg * 64 + warp * 16 + lane / 4;
      // (packed: the rows past the sequence's keys are the next sequence's where the tensor goes on; paged: the rest
      // of the last page, unused slots)
      const bool tail = kMask != kMaskSpans && p.cu_seqlens_q != nullptr &&
                        (p.block_table != nullptr || w.k_row0 + w.kv_len < p.total_k);
      ConsumerRows rows{wg,        row0, w.m0 + wg * 64, lane, kMask == kMaskSpans ? 1.f : p.scale * kLog2e,
                        w.n_first, kv,   w.kv_len,       w.causal_offset, tail ? w.kv_len : INT64_MAX};
      if constexpr (kMask == kMaskSpans) {
        rows.spans = {{key_span(p, w.b, w.h, row0), key_span(p, w.b, w.h, row0 + 8)}, w.b, w.h};
        rows.full_lo = span_bounds[2 + 2 * wg];
        rows.full_hi = span_bounds[3 + 2 * wg];
      }

      float o[kD / 2];  // O, m, l of the thread's two rows
#pragma unroll
      for (int j = 0; j < kD / 2; ++j) o[j] = 0.f;
      float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
      if (w.n_tiles > 0) {
        const int n_own = own_key_tiles<Traits, kMask>(w, rows.wg_first);
        if constexpr (Traits::kOverlap) mainloop_overlapped<Traits, kMask>(sm, q_w, p, rows, n_own, w.n_tiles, o, m, l);
        else mainloop_serial<Traits, kMask>(sm, q_w, p, rows, n_own, w.n_tiles, o, m, l);
      }
      if (Traits::kOwnOBuffer) {  // every product of the tile is done, every lane has read sm.tile: Q may be replaced
        __syncwarp();
        release(sm.q_empty, lane);
      }
      write_out_lse<Traits>(o, m, l, p, sm.o, wg, w, kMask == kMaskSpans ? kLn2 : p.scale);
      if (!Traits::kOwnOBuffer) {  // O was staged in Q's buffer: the copy engine may overwrite it once the warp is done
        fence_proxy_async();
        __syncwarp();
        release(sm.q_empty, lane);
      }
      kv += static_cast<uint32_t>(w.n_tiles);
      if (!dynamic) tile = next_tile<kMask>(i + 1, blockIdx.x, gridDim.x, nullptr);
    }
  }
#endif
}

// ---- host launch -------------------------------------------------------------------------------------------------------
// kSpans: the key-spans kernel (the call has attn_mask or a window), else the plain or causal one. tile_counter: null,
// or (the plain and causal kernels then persistent and dynamic) an int in device memory that is 0.
template <class Traits, bool kSpans>
cudaError_t launch_flash_fwd_hopper(const AttentionParams& p, cudaStream_t stream, int* tile_counter = nullptr) {
  const unsigned m_blocks = static_cast<unsigned>((p.q_len + Traits::kBlockM - 1) / Traits::kBlockM);
  const unsigned heads = static_cast<unsigned>(p.batch * p.num_heads);
  if (heads == 0 || m_blocks == 0) return cudaSuccess;  // no query rows: nothing to write
  if (kSpans != has_mask_or_window(p)) return cudaErrorInvalidValue;
  if (p.block_table != nullptr && Traits::kBlockN != kPagedKeyTile) return cudaErrorInvalidValue;  // (load_kv's pages)
  void (*kernel)(const CUtensorMap, const CUtensorMap, const CUtensorMap, const AttentionParams, int, int*);
  if constexpr (kSpans)
    kernel = flash_fwd_hopper_kernel<Traits, kMaskSpans>;
  else
    kernel = p.is_causal ? flash_fwd_hopper_kernel<Traits, kMaskCausal> : flash_fwd_hopper_kernel<Traits, kMaskNone>;

  if (p.cu_seqlens_q != nullptr && (kSpans || p.total_q <= 0 || p.total_k <= 0)) return cudaErrorInvalidValue;
  const auto [map_batch, q_rows, kv_rows] = map_extent(p);
  CUtensorMap tm_q, tm_k, tm_v;
  cudaError_t err = make_head_rows_map(&tm_q, p.dtype, p.q, Traits::kHeadDim, q_rows, p.num_heads, map_batch,
                                       p.q_strides, Traits::kBlockM);
  if (err == cudaSuccess)
    err = make_head_rows_map(&tm_k, p.dtype, p.k, Traits::kHeadDim, kv_rows, p.num_kv_heads, map_batch, p.k_strides,
                             Traits::kBlockN);
  if (err == cudaSuccess)
    err = make_head_rows_map(&tm_v, p.dtype, p.v, Traits::kHeadDim, kv_rows, p.num_kv_heads, map_batch, p.v_strides,
                             Traits::kBlockN);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;

  // A block per work tile, or per SM (persistent: one block fits an SM).
  const int64_t tiles = static_cast<int64_t>(heads) * m_blocks;
  if (tiles > INT_MAX - 65536) return cudaErrorInvalidValue;  // (next_tile's ids reach tiles + gridDim.x)
  int device = 0, sms = 0;
  err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (kSpans) tile_counter = nullptr;
  const bool persistent = !kSpans && (!p.is_causal || tile_counter != nullptr);
  const unsigned grid = static_cast<unsigned>(persistent ? std::min<int64_t>(tiles, std::max(sms, 1)) : tiles);
  int heads_per_group = 1;
  if (err == cudaSuccess && p.is_causal && !kSpans)  // (kMaskCausal's order)
    err = group_heads(kernel, Traits::kNThreads, Traits::kSmemBytes, m_blocks, &heads_per_group);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(tm_q, tm_k, tm_v, p, heads_per_group, tile_counter);
  return cudaGetLastError();
}

}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
