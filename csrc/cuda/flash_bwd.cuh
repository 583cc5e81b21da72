// FlashAttention-2 backward on tensor cores (the paper's Algorithm 2; csrc/kernels/flash_backward.cpp on the CPU).
//
// From the forward's lse, P is recomputed tile by tile; nothing N x N is ever stored:
//   D_i  = rowsum(dO_i ∘ O_i)                                      (flash_bwd_delta_kernel)
//   for each key tile j (one thread block, block_k keys; dK_j, dV_j in registers):
//     for each query head of j's kv head and each query tile i that sees these keys:
//       Sᵀ  = K_j Q_iᵀ;   Pᵀ = exp(scale·Sᵀ − lse_i)               (warp tiles of keys x queries)
//       dPᵀ = V_j dO_iᵀ;  dSᵀ = Pᵀ ∘ (dPᵀ − D_i)                   (Pᵀ, dSᵀ -> shared memory)
//       dV_j += Pᵀ dO_i;  dK_j += dSᵀ Q_i                          (warp tiles of keys x head dim)
//       dQ_i += dS K_j                                             (float32 atomics: blocks share dQ_i)
//   dK *= scale (here); dQ = scale·dQ (flash_api.cpp, when it converts dQ to the input dtype).
// Working on Sᵀ (keys as rows) keeps dK and dV, which stay in registers for the whole block, row-major in keys.
// kGeneral: attn_mask, window, softcap, ALiBi, dropout (flash_mask.cuh's pipeline recomputes the forward's P and its
// dropout bits); query tiles outside the window's band are never visited, and a step whose rows' key spans miss this
// block's keys is skipped.
#pragma once

#include <cmath>
#include <type_traits>

#include "flash_common.cuh"
#include "flash_cuda.h"
#include "flash_mask.cuh"
#include "kernel_traits.cuh"
#include "warp_gemm.cuh"

namespace cs149gpt {
namespace cuda {

// The per-row statistics the backward reads, in the workspace `stats` (flash_cuda.h: bwd_row_stats_floats, its
// layout), 16-byte aligned so that the main kernels copy them with 16-byte copies, off their critical path.
__device__ __forceinline__ int64_t q_padded(int64_t q_len) { return round_up4(q_len); }

// Task `task` of bwd_stats_tasks(all) (flash_cuda.h) as its row i of (batch or sequence b, head h); false where it
// is no sequence's row (packed: rows before the first or after the last). Packed: t's sequence is the last b with
// cu_seqlens_q[b] <= t, by binary search.
__device__ __forceinline__ bool bwd_stats_task(const AttentionParams& all, int64_t task, int64_t& b, int64_t& h,
                                               int64_t& i) {
  if (all.cu_seqlens_q == nullptr) {
    const int64_t bh = task / all.q_len;
    i = task % all.q_len, b = bh / all.num_heads, h = bh % all.num_heads;
    return true;
  }
  h = task / all.total_q;
  const int64_t t = task % all.total_q;
  const int32_t* cu = all.cu_seqlens_q;
  if (t < cu[0] || t >= cu[all.batch]) return false;
  int64_t lo = 0, hi = all.batch;  // cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= t) lo = mid;
    else hi = mid;
  }
  b = lo, i = t - cu[lo];
  return true;
}

// D_i = sum_d dO[i, d] O[i, d] and lse_i·log2(e), one warp per row of a sequence; rows past q_len are never read.
template <class T, int kHeadDim>
__global__ void flash_bwd_delta_kernel(const AttentionBackwardParams params, float* stats) {
  const AttentionParams& all = params.fwd;  // packed sequences: every sequence, sequence b's below
  const int64_t task = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  int64_t b, h, i;
  if (task >= bwd_stats_tasks(all) || !bwd_stats_task(all, task, b, h, i)) return;
  const AttentionBackwardParams bp = sequence_view(params, b);
  const AttentionParams& p = bp.fwd;
  const T* o = head_ptr(static_cast<const T*>(p.out), p.out_strides, b, h) + i * p.out_strides[2];
  const T* dout = head_ptr(static_cast<const T*>(bp.dout), bp.dout_strides, b, h) + i * bp.dout_strides[2];
  float sum = 0.f;
#pragma unroll
  for (int c = lane * 2; c < kHeadDim; c += 64) {
    const float2 a = unpack2<T>(*reinterpret_cast<const uint32_t*>(o + c));
    const float2 g = unpack2<T>(*reinterpret_cast<const uint32_t*>(dout + c));
    sum += a.x * g.x + a.y * g.y;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  if (lane == 0) {
    const int64_t at = bwd_stats_row0(all, b, h) + i;
    const float lse = p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i];
    stats[at] = sum;
    stats[bwd_stats_half(all) + at] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }
}

// dq_accum[i, :] += the warp's dQ tile (kMi m16 row tiles x kNj n8 column tiles, C fragments), rows past q_len
// dropped. Four adjacent columns per reduction: lanes t and t ^ 1 of a quad swap halves so that the even lane
// holds row g, columns 4(t/2) .. +3 and the odd lane row g + 8, the same columns.
template <int kHeadDim, int kMi, int kNj>
__device__ __forceinline__ void add_dq(float* dq_accum, int64_t q_len, int64_t row0, int col0,
                                       const float (&acc)[kMi][kNj][4], int lane) {
  const bool odd = lane % 2;
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi) {
    const int64_t i = row0 + mi * 16 + lane / 4 + (odd ? 8 : 0);
#pragma unroll
    for (int n = 0; n < kNj; ++n) {
      // even lane sends its row g + 8 pair and keeps row g; odd lane sends its row g pair and keeps row g + 8
      const float send0 = odd ? acc[mi][n][0] : acc[mi][n][2], send1 = odd ? acc[mi][n][1] : acc[mi][n][3];
      const float got0 = __shfl_xor_sync(0xffffffff, send0, 1), got1 = __shfl_xor_sync(0xffffffff, send1, 1);
      const float4 v = odd ? make_float4(got0, got1, acc[mi][n][2], acc[mi][n][3])
                           : make_float4(acc[mi][n][0], acc[mi][n][1], got0, got1);
      if (i < q_len) atomic_add4(dq_accum + i * kHeadDim + col0 + n * 8 + (lane % 4 / 2) * 4, v);
    }
  }
}

// The first row of (batch b, query head h) in dq_accum (flash_cuda.h): (batch, heads, q_len, d), or for packed
// sequences (heads, total_q, d), total_q = lse_strides[1] (lse's (heads, total_q)), sequence b at cu_seqlens_q[b].
__device__ __forceinline__ int64_t dq_accum_offset(const AttentionParams& all, int64_t b, int64_t h, int kHeadDim) {
  if (all.cu_seqlens_q) return (h * all.lse_strides[1] + all.cu_seqlens_q[b]) * kHeadDim;
  return (b * all.num_heads + h) * all.q_len * kHeadDim;
}

// Writes a warp's C fragments (kMi m16 x kNj n8, rounded to T) into a row-major shared-memory tile.
template <class T, int kLd, int kMi, int kNj>
__device__ __forceinline__ void store_c_frags(T* tile, const float (&c)[kMi][kNj][4], int lane) {
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
    for (int n = 0; n < kNj; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        *reinterpret_cast<uint32_t*>(tile + (mi * 16 + lane / 4 + r * 8) * kLd + n * 8 + (lane % 4) * 2) =
            pack2<T>(c[mi][n][2 * r], c[mi][n][2 * r + 1]);
}

// Grid: (key blocks, kv heads, batch), or with kPerQueryHead (key blocks, query heads, batch): a block then takes
// one query head of its kv head's group and writes that head's share of dK, dV at the query head's index (the
// caller sums the group), so that GQA has as many blocks as plain attention. Without a mask the key blocks of a
// head run side by side and share its Q, dO in L2; under a causal mask the grid is one dimension in
// grouped_heavy_first's order (flash_common.cuh).
template <class Traits, bool kIsCausal, bool kPerQueryHead, bool kGeneral = false, bool kDeterministic = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_kernel(const AttentionBackwardParams params, const float* stats, float* dq_accum, int heads_per_group) {
  using T = typename Traits::T;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kNThreads = Traits::kNThreads;
  constexpr int kLdKV = Traits::KVTile::kStride, kLdQ = Traits::QTile::kStride, kLdP = Traits::PTile::kStride;
  extern __shared__ __align__(16) char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + Traits::KVTile::kElems;
  T* sQ = sV + Traits::KVTile::kElems;      // [2]
  T* sdO = sQ + 2 * Traits::QTile::kElems;  // [2]
  T* sPt = sdO + 2 * Traits::QTile::kElems;
  T* sdSt = sPt + Traits::PTile::kElems;
  float* sLse = reinterpret_cast<float*>(sdSt + Traits::PTile::kElems);  // [2][kBlockM], in exp2 units
  float* sDelta = sLse + 2 * kBlockM;                                    // [2][kBlockM]
  int4* sSpan = reinterpret_cast<int4*>(sDelta + 2 * kBlockM);  // kGeneral: [2][kBlockM] rows' key spans

  const AttentionParams& all = params.fwd;  // packed sequences: batch counts them, the key blocks are the longest's
  const int64_t heads_here = kPerQueryHead ? all.num_heads : all.num_kv_heads;
  int n_block, bh;
  if constexpr (kIsCausal) {  // grouped_heavy_first: a head's first key block is its costliest
    const int n_blocks = static_cast<int>((all.kv_len + kBlockN - 1) / kBlockN);
    const HeadTile ht = grouped_heavy_first(blockIdx.x, static_cast<int>(all.batch * heads_here), n_blocks,
                                            heads_per_group);
    n_block = ht.tile_rank;
    bh = ht.head;
  } else {
    n_block = blockIdx.x;
    bh = blockIdx.z * heads_here + blockIdx.y;
  }
  const int64_t b = bh / heads_here, head = bh % heads_here;
  // Sequence b of packed sequences as a call of its own (its rows, lengths, causal offset); a dense call as it is.
  const AttentionBackwardParams bp = sequence_view(params, b);
  const AttentionParams& p = bp.fwd;
  if (static_cast<int64_t>(n_block) * kBlockN >= p.kv_len) return;  // (packed: a block past its sequence's keys)
  const int64_t hk = kPerQueryHead ? head / (p.num_heads / p.num_kv_heads) : head;
  // The query heads this block visits: h_first .. h_first + group - 1.
  const int group = kPerQueryHead ? 1 : static_cast<int>(p.num_heads / p.num_kv_heads);
  const int64_t h_first = kPerQueryHead ? head : hk * group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n0 = static_cast<int64_t>(n_block) * kBlockN;
  const int keys_valid = static_cast<int>(min64(kBlockN, p.kv_len - n0));
  const float scale_log2 = p.scale * kLog2e;

  // This warp's tiles of the five products (traits: the warp grids).
  const int sdp_key0 = (warp % Traits::kWarpsKeysSdP) * Traits::kSdpKeys;
  const int sdp_q0 = (warp / Traits::kWarpsKeysSdP) * Traits::kSdpQueries;
  const int kv_key0 = (warp % Traits::kWarpsKeysKV) * Traits::kKvKeys;
  const int kv_col0 = (warp / Traits::kWarpsKeysKV) * Traits::kKvCols;
  const int dq_row0 = (warp % Traits::kWarpsRowsDq) * Traits::kDqRows;
  const int dq_col0 = (warp / Traits::kWarpsRowsDq) * Traits::kDqCols;
  constexpr int kSdpMi = Traits::kSdpKeys / 16, kSdpNj = Traits::kSdpQueries / 8;
  constexpr int kKvMi = Traits::kKvKeys / 16, kKvNj = Traits::kKvCols / 8;
  constexpr int kDqMi = Traits::kDqRows / 16, kDqNj = Traits::kDqCols / 8;

  // The query tiles that see some key of this block: all, or under the causal mask those with a row
  // i >= n0 - causal_offset.
  const int m_tiles_all = static_cast<int>((p.q_len + kBlockM - 1) / kBlockM);
  int m_first = kIsCausal ? static_cast<int>(min64(m_tiles_all, max64(0, n0 - p.causal_offset) / kBlockM)) : 0;
  int m_end = m_tiles_all;  // query tiles m_first .. m_end - 1
  if constexpr (kGeneral) {  // rows [row_first, row_end) may see a key of n0 .. n0 + keys_valid - 1
    int64_t row_first = 0, row_end = p.q_len;
    if (p.is_causal) row_first = max64(row_first, n0 - p.causal_offset);
    if (p.window_right >= 0) row_first = max64(row_first, n0 - p.window_offset - p.window_right);
    if (p.window_left >= 0) row_end = min64(row_end, n0 + keys_valid - p.window_offset + p.window_left);
    m_first = static_cast<int>(min64(m_tiles_all, row_first / kBlockM));
    m_end = static_cast<int>(max64(m_first, min64(m_tiles_all, (row_end + kBlockM - 1) / kBlockM)));
  }
  const int m_tiles = m_end - m_first;
  const int steps = group * m_tiles;  // (query head of the group, query tile) pairs, query tiles fastest

  const T* k = head_ptr(static_cast<const T*>(p.k), p.k_strides, b, hk) + n0 * p.k_strides[2];
  const T* v = head_ptr(static_cast<const T*>(p.v), p.v_strides, b, hk) + n0 * p.v_strides[2];
  copy_tile_async<typename Traits::KVTile, kNThreads>(sK, k, p.k_strides[2], keys_valid);
  copy_tile_async<typename Traits::KVTile, kNThreads>(sV, v, p.v_strides[2], keys_valid);

  const int64_t head_stride = bwd_stats_head_stride(all);
  const float* delta_rows = stats + bwd_stats_row0(all, b, 0);  // head h's rows from h · head_stride on
  const float* lse2_rows = delta_rows + bwd_stats_half(all);
  // Copies the step (query head h, query rows m0 ..) into buffer buf, asynchronously: Q, dO, lse·log2e, D.
  auto load_step = [&](int h, int64_t m0, int buf) {
    const int rows = static_cast<int>(min64(kBlockM, p.q_len - m0));
    copy_tile_async<typename Traits::QTile, kNThreads>(
        sQ + buf * Traits::QTile::kElems, head_ptr(static_cast<const T*>(p.q), p.q_strides, b, h) + m0 * p.q_strides[2],
        p.q_strides[2], rows);
    copy_tile_async<typename Traits::QTile, kNThreads>(
        sdO + buf * Traits::QTile::kElems,
        head_ptr(static_cast<const T*>(bp.dout), bp.dout_strides, b, h) + m0 * bp.dout_strides[2], bp.dout_strides[2],
        rows);
    // (rows past q_len read 0 here; the mask zeroes their P)
    copy_floats_async<kBlockM>(sLse + buf * kBlockM, lse2_rows + h * head_stride + m0, rows);
    copy_floats_async<kBlockM>(sDelta + buf * kBlockM, delta_rows + h * head_stride + m0, rows);
    if constexpr (kGeneral)
      if (threadIdx.x < kBlockM) {
        const KeySpan span = key_span(p, b, h, m0 + threadIdx.x);
        sSpan[buf * kBlockM + threadIdx.x] = make_int4(span.lo, span.hi, span.exact, 0);
      }
  };
  // The step's query head and tile, advanced without a division: (h, mt) now, (h_next, mt_next) one step ahead.
  int h = static_cast<int>(h_first);
  int mt = m_first;
  if (steps > 0) load_step(h, static_cast<int64_t>(mt) * kBlockM, 0);
  cp_async_commit();

  float dk[kKvMi][kKvNj][4], dv[kKvMi][kKvNj][4];
  zero_frags(dk);
  zero_frags(dv);
  [[maybe_unused]] const bool dropout = kGeneral && p.dropout_p > 0.f;
  // kGeneral: a step whose rows all see the block's keys whole (`whole`) takes tile_backward's kWhole shortcut,
  // without dropout, softcap or ALiBi.
  [[maybe_unused]] const bool plain_logits = kGeneral && !dropout && !(p.softcap > 0.f) && p.alibi_slopes == nullptr;

  for (int s = 0; s < steps; ++s) {
    const int buf = s % 2;
    const int64_t m0 = static_cast<int64_t>(mt) * kBlockM;
    const bool last_tile = mt + 1 == m_end;
    const int h_next = last_tile ? h + 1 : h;
    const int mt_next = last_tile ? m_first : mt + 1;
    cp_async_wait<0>();
    // step s is in buffer s % 2; every warp is done with the other buffer and with sPt, sdSt. kGeneral: whether some
    // row of the step may see a key of this block (each thread reads the span it wrote itself).
    bool seen = true;
    [[maybe_unused]] bool whole = false;  // kGeneral: every row of the step sees all kBlockN keys, no entry to read
    if constexpr (kGeneral) {
      const int t = threadIdx.x;
      const int4 span = t < kBlockM ? sSpan[buf * kBlockM + t] : make_int4(0, 0, 1, 0);
      seen = __syncthreads_or(span.x < span.y && span.x < n0 + keys_valid && span.y > n0);
      whole = __syncthreads_and(t >= kBlockM || (span.z != 0 && span.x <= n0 && span.y >= n0 + kBlockN));
    } else {
      __syncthreads();
    }
    if (s + 1 < steps) load_step(h_next, static_cast<int64_t>(mt_next) * kBlockM, buf ^ 1);
    cp_async_commit();
    // The deterministic order (AttentionBackwardParams::dq_tickets): the counter of query tile mt, and this block's
    // rank among the key tiles that visit it, consecutive ones: from key tile 0, or under a left window bound from the
    // first whose keys reach the tile's first row's window. (Found where used: no register of the loop holds them.)
    const auto ticket = [&] {  // (the tile's first row's; packed: its packed row, in one batch)
      const int64_t bm = all.cu_seqlens_q != nullptr ? 0 : b;
      const int64_t row = (all.cu_seqlens_q != nullptr ? all.cu_seqlens_q[b] : 0) + m0;
      return params.dq_tickets + ((bm * all.num_heads + h) * params.dq_ticket_rows + row) * 2;
    };
    const auto rank = [&] {
      const int64_t first_key = kGeneral && p.window_left >= 0 ? m0 + p.window_offset - p.window_left : 0;
      return n_block - static_cast<int>(max64(0, first_key) / kBlockN);
    };
    if (!seen) {
      if (kDeterministic && threadIdx.x == 0) {  // its turn passed on, with nothing added
        wait_for_turn(ticket(), rank());
        add_release_gpu(ticket(), 1);
      }
      h = h_next;
      mt = mt_next;
      continue;
    }
    const T* sQs = sQ + buf * Traits::QTile::kElems;
    const T* sdOs = sdO + buf * Traits::QTile::kElems;
    const float* lse2 = sLse + buf * kBlockM;
    const float* d_row = sDelta + buf * kBlockM;

    // Sᵀ = K Qᵀ (the warp's keys x queries); Pᵀ = exp2(scale·log2e · Sᵀ − lse·log2e), masked keys and queries 0.
    float pt[kSdpMi][kSdpNj][4];
    zero_frags(pt);
    warp_gemm_ss<T, kSdpMi, kSdpNj, kD, kLdKV, false, kLdQ, false>(pt, sK + sdp_key0 * kLdKV, sQs + sdp_q0 * kLdQ,
                                                                   lane);
    float dst[kSdpMi][kSdpNj][4];
    if constexpr (kGeneral) {
      // dPᵀ = V dOᵀ; then P, dS and the dropped Pᵀ in one pass over both (flash_mask.cuh).
      zero_frags(dst);
      warp_gemm_ss<T, kSdpMi, kSdpNj, kD, kLdKV, false, kLdQ, false>(dst, sV + sdp_key0 * kLdKV,
                                                                     sdOs + sdp_q0 * kLdQ, lane);
      if (whole && plain_logits) {
        tile_backward<kSdpMi, kSdpNj, true>(pt, dst, p, Logits(), Dropout(), false, nullptr, lse2, d_row, m0, n0,
                                            sdp_key0, sdp_q0, lane);
      } else {
        const Logits logits(p, b, h);
        const Dropout z = dropout ? Dropout(p, b, h) : Dropout();
        tile_backward(pt, dst, p, logits, z, dropout, sSpan + buf * kBlockM, lse2, d_row, m0, n0, sdp_key0, sdp_q0,
                      lane);
      }
    } else {
      // In tile coordinates: key kj (< keys_valid) is visible to query qi (< rows_valid) iff kj - qi <= diag.
      const int rows_valid = static_cast<int>(min64(kBlockM, p.q_len - m0));
      const int64_t diag64 = m0 + p.causal_offset - n0;
      const bool needs_mask = keys_valid < kBlockN || rows_valid < kBlockM || (kIsCausal && diag64 < kBlockN - 1);
      const int diag = static_cast<int>(max64(-2 * kBlockN, min64(diag64, 2 * kBlockN)));
#pragma unroll
      for (int mi = 0; mi < kSdpMi; ++mi)
#pragma unroll
        for (int n = 0; n < kSdpNj; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qi = sdp_q0 + n * 8 + (lane % 4) * 2 + (e % 2);  // query within the tile
            float x = exp2_approx(fmaf(pt[mi][n][e], scale_log2, -lse2[qi]));
            if (needs_mask) {
              const int kj = sdp_key0 + mi * 16 + lane / 4 + (e / 2) * 8;  // key within the block
              if (!(qi < rows_valid && kj < keys_valid && (!kIsCausal || kj - qi <= diag))) x = 0.f;
            }
            pt[mi][n][e] = x;
          }

      // dPᵀ = V dOᵀ;  dSᵀ = Pᵀ ∘ (dPᵀ − D), in place.
      zero_frags(dst);
      warp_gemm_ss<T, kSdpMi, kSdpNj, kD, kLdKV, false, kLdQ, false>(dst, sV + sdp_key0 * kLdKV, sdOs + sdp_q0 * kLdQ,
                                                                     lane);
#pragma unroll
      for (int mi = 0; mi < kSdpMi; ++mi)
#pragma unroll
        for (int n = 0; n < kSdpNj; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            dst[mi][n][e] = pt[mi][n][e] * (dst[mi][n][e] - d_row[sdp_q0 + n * 8 + (lane % 4) * 2 + (e % 2)]);
    }

    // Pᵀ and dSᵀ to shared memory: the products below need other warps' keys and queries.
    store_c_frags<T, kLdP>(sPt + sdp_key0 * kLdP + sdp_q0, pt, lane);
    store_c_frags<T, kLdP>(sdSt + sdp_key0 * kLdP + sdp_q0, dst, lane);
    __syncthreads();

    // dV += Pᵀ dO;  dK += dSᵀ Q  (the warp's keys x head-dim columns; dO, Q stored (query, d): k-major B).
    warp_gemm_ss<T, kKvMi, kKvNj, kBlockM, kLdP, false, kLdQ, true>(dv, sPt + kv_key0 * kLdP, sdOs + kv_col0, lane);
    warp_gemm_ss<T, kKvMi, kKvNj, kBlockM, kLdP, false, kLdQ, true>(dk, sdSt + kv_key0 * kLdP, sQs + kv_col0, lane);

    // dQ_i += dS K_j (the warp's queries x head-dim columns): A = dS read from dSᵀ, B = K stored (key, d).
    float dq[kDqMi][kDqNj][4];
    zero_frags(dq);
    warp_gemm_ss<T, kDqMi, kDqNj, kBlockN, kLdP, true, kLdKV, true>(dq, sdSt + dq_row0, sK + dq_col0, lane);
    if constexpr (kDeterministic) {  // after the key tiles before this one (every thread's additions after the wait)
      if (threadIdx.x == 0) wait_for_turn(ticket(), rank());
      __syncthreads();
    }
    add_dq<kD>(dq_accum + dq_accum_offset(all, b, h, kD), p.q_len, m0 + dq_row0, dq_col0, dq, lane);
    if constexpr (kDeterministic) {  // every thread's additions before the count
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        add_release_gpu(ticket(), 1);
      }
    }
    h = h_next;
    mt = mt_next;
  }

  cp_async_wait<0>();  // (when no query tile sees these keys, K and V were copied and never waited for)

  // dK (scaled) and dV of this block's keys, summed over the query heads it visited.
  T* dk_out = head_ptr(static_cast<T*>(bp.dk), bp.dk_strides, b, head) + n0 * bp.dk_strides[2];
  T* dv_out = head_ptr(static_cast<T*>(bp.dv), bp.dv_strides, b, head) + n0 * bp.dv_strides[2];
#pragma unroll
  for (int mi = 0; mi < kKvMi; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = kv_key0 + mi * 16 + lane / 4 + r * 8;
      if (key < keys_valid) {
#pragma unroll
        for (int n = 0; n < kKvNj; ++n) {
          const int col = kv_col0 + n * 8 + (lane % 4) * 2;
          *reinterpret_cast<uint32_t*>(dk_out + key * bp.dk_strides[2] + col) =
              pack2<T>(dk[mi][n][2 * r] * p.scale, dk[mi][n][2 * r + 1] * p.scale);
          *reinterpret_cast<uint32_t*>(dv_out + key * bp.dv_strides[2] + col) =
              pack2<T>(dv[mi][n][2 * r], dv[mi][n][2 * r + 1]);
        }
      }
    }
}

// D = rowsum(dO ∘ O) and lse·log2(e) per query row (flash_bwd_delta_kernel, a warp a row): both backwards' first step.
template <class Traits>
cudaError_t launch_row_stats(const AttentionBackwardParams& bp, float* stats, cudaStream_t stream) {
  const int64_t rows = bwd_stats_tasks(bp.fwd);
  if (rows == 0) return cudaSuccess;
  flash_bwd_delta_kernel<typename Traits::T, Traits::kHeadDim>
      <<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, stream>>>(bp, stats);
  return cudaGetLastError();
}

template <class Traits>
cudaError_t launch_flash_bwd(const AttentionBackwardParams& bp, float* stats, float* dq_accum, bool per_query_head,
                             cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  cudaError_t err = launch_row_stats<Traits>(bp, stats, stream);
  if (err != cudaSuccess) return err;
  const unsigned heads_here = static_cast<unsigned>(per_query_head ? p.num_heads : p.num_kv_heads);
  const unsigned heads = static_cast<unsigned>(p.batch) * heads_here;
  const unsigned n_blocks = static_cast<unsigned>((p.kv_len + Traits::kBlockN - 1) / Traits::kBlockN);
  if (heads == 0 || n_blocks == 0) return cudaSuccess;  // no keys: dK, dV are empty, dQ stays 0
  const dim3 grid = p.is_causal ? dim3(heads * n_blocks) : dim3(n_blocks, heads_here, static_cast<unsigned>(p.batch));
  // kDeterministic: instantiations of their own, so that the default kernels carry none of the order's code.
  const auto pick = [&](auto deterministic) {
    constexpr bool kDet = decltype(deterministic)::value;
    return p.is_causal ? (per_query_head ? flash_bwd_kernel<Traits, true, true, false, kDet>
                                         : flash_bwd_kernel<Traits, true, false, false, kDet>)
                       : (per_query_head ? flash_bwd_kernel<Traits, false, true, false, kDet>
                                         : flash_bwd_kernel<Traits, false, false, false, kDet>);
  };
  auto kernel = bp.dq_tickets != nullptr ? pick(std::true_type{}) : pick(std::false_type{});
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  int heads_per_group = 1;
  if (p.is_causal) err = group_heads(kernel, Traits::kNThreads, Traits::kSmemBytes, n_blocks, &heads_per_group);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(bp, stats, dq_accum, heads_per_group);
  return cudaGetLastError();
}

// The general kernel (attn_mask, window, softcap, ALiBi, dropout), causal or not at run time: grid (key blocks,
// heads, batch), with the rows' key spans in shared memory besides the plain kernel's tiles.
template <class Traits>
cudaError_t launch_flash_bwd_general(const AttentionBackwardParams& bp, float* stats, float* dq_accum,
                                     bool per_query_head, cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  cudaError_t err = launch_row_stats<Traits>(bp, stats, stream);
  if (err != cudaSuccess) return err;
  const unsigned heads_here = static_cast<unsigned>(per_query_head ? p.num_heads : p.num_kv_heads);
  const unsigned n_blocks = static_cast<unsigned>((p.kv_len + Traits::kBlockN - 1) / Traits::kBlockN);
  if (p.batch * heads_here == 0 || n_blocks == 0) return cudaSuccess;
  const auto pick = [&](auto deterministic) {
    constexpr bool kDet = decltype(deterministic)::value;
    return per_query_head ? flash_bwd_kernel<Traits, false, true, true, kDet>
                          : flash_bwd_kernel<Traits, false, false, true, kDet>;
  };
  auto kernel = bp.dq_tickets != nullptr ? pick(std::true_type{}) : pick(std::false_type{});
  const int smem = Traits::kSmemBytes + 2 * Traits::kBlockM * static_cast<int>(sizeof(int4));
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(n_blocks, heads_here, static_cast<unsigned>(p.batch)), Traits::kNThreads, smem, stream>>>(bp, stats,
                                                                                                       dq_accum, 1);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace cs149gpt
