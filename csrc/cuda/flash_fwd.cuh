// FlashAttention-2 forward on tensor cores: the same loop as csrc/kernels/flash.cpp and the paper's
// Algorithm 1, for one Br x d block of queries per thread block, with S = Q Kᵀ and O += P V on mma.sync.
//
//   for each key tile j (Bc rows), K_j and V_j copied to shared memory while tile j-1 is multiplied:
//     S    = Q K_jᵀ                                (16 query rows per warp; Q held in registers)
//     m'   = max(m, rowmax(S));   P = exp(scale·(S − m'))
//     l    = e^{scale(m − m')} l + rowsum(P);   O = e^{scale(m − m')} O + P V_j;   m = m'
//   O /= l;   lse = scale·m + log l
//
// Everything below is in exp2: scale·log2(e) is folded into one multiply-add per score.
// kGeneral: the same loop for calls with attn_mask, a window, softcap, ALiBi or dropout (flash_mask.cuh's pipeline on
// S, in base 2, before the softmax), visiting only the key tiles some row of the block may see.
#pragma once

#include <cmath>

#include "flash_common.cuh"
#include "flash_mask.cuh"
#include "kernel_traits.cuh"
#include "warp_gemm.cuh"

namespace cs149gpt {
namespace cuda {

// Masks keys past the end and, under the causal mask, keys past each row's diagonal: S = -inf there.
// row0: the thread's first row within the block (its second is row0 + 8); n0: the tile's first key.
template <class Traits, bool kIsCausal>
__device__ __forceinline__ void mask_scores(float (&s)[Traits::kBlockN / 8][4], const AttentionParams& p, int64_t m0,
                                            int row0, int64_t n0, int lane) {
#pragma unroll
  for (int n = 0; n < Traits::kBlockN / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t i = m0 + row0 + (e / 2) * 8;
      const int64_t key = n0 + n * 8 + (lane % 4) * 2 + (e % 2);
      if (!(key < p.kv_len && (!kIsCausal || key <= i + p.causal_offset))) s[n][e] = -INFINITY;
    }
}

// The online-softmax step on one tile of scores, for the thread's rows r = 0 (g) and r = 1 (g + 8):
//   m' = max(m, rowmax S);  P = exp(scale (S - m'));  alpha = e^{scale(m - m')};  l = alpha l + rowsum P
// In place: S becomes P; O *= alpha is left to rescale_o. m is in raw logits; a row that has seen no key keeps
// m = -inf and P = 0, no NaN. l is this thread's part of the row sum; the quad's four parts are added once, at
// the end.
template <class Traits>
__device__ __forceinline__ void online_softmax(float (&s)[Traits::kBlockN / 8][4], float (&m)[2], float (&l)[2],
                                               float (&alpha)[2], float scale_log2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float row_max = m[r];
#pragma unroll
    for (int n = 0; n < Traits::kBlockN / 8; ++n) row_max = fmaxf(row_max, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
    row_max = quad_max(row_max);
    // The shift in exp2 units; 0 while the row has seen nothing (then every P is exp2(-inf) = 0).
    const float shift = row_max == -INFINITY ? 0.f : row_max * scale_log2;
    alpha[r] = exp2_approx(m[r] * scale_log2 - shift);  // 0 when m = -inf, exactly 1 when the max stays
    m[r] = row_max;
    float row_sum = 0.f;
#pragma unroll
    for (int n = 0; n < Traits::kBlockN / 8; ++n) {
      s[n][2 * r] = exp2_approx(fmaf(s[n][2 * r], scale_log2, -shift));
      s[n][2 * r + 1] = exp2_approx(fmaf(s[n][2 * r + 1], scale_log2, -shift));
      row_sum += s[n][2 * r] + s[n][2 * r + 1];
    }
    l[r] = l[r] * alpha[r] + row_sum;
  }
}

// O *= alpha, row by row.
template <class Traits>
__device__ __forceinline__ void rescale_o(float (&o)[Traits::kMi][Traits::kHeadDim / 8][4],
                                          const float (&alpha)[Traits::kMi][2]) {
#pragma unroll
  for (int mi = 0; mi < Traits::kMi; ++mi)
#pragma unroll
    for (int n = 0; n < Traits::kHeadDim / 8; ++n) {
      o[mi][n][0] *= alpha[mi][0];
      o[mi][n][1] *= alpha[mi][0];
      o[mi][n][2] *= alpha[mi][1];
      o[mi][n][3] *= alpha[mi][1];
    }
}

// Keys n1 .. n1 + keys − 1 of k and v (their kv head's rows) into buffer buf of sK and sV: rows strides[2] apart, or
// with `paged` a paged cache's, gathered through the sequence's table.
template <class Traits, class T>
__device__ __forceinline__ void copy_kv_tiles(T* sK, T* sV, int buf, const T* k, const T* v, const AttentionParams& p,
                                              bool paged, int64_t n1, int keys) {
  using Tile = typename Traits::KVTile;
  constexpr int kNThreads = Traits::kNThreads;
  if (paged) {
    copy_paged_kv_tiles_async<Tile, kNThreads>(sK + buf * Tile::kElems, sV + buf * Tile::kElems, k, v, p, n1, keys);
  } else {
    copy_tile_async<Tile, kNThreads>(sK + buf * Tile::kElems, k + n1 * p.k_strides[2], p.k_strides[2], keys);
    copy_tile_async<Tile, kNThreads>(sV + buf * Tile::kElems, v + n1 * p.v_strides[2], p.v_strides[2], keys);
  }
}

// kPacked: packed sequences (params.cu_seqlens_q set), a kernel of its own so that a dense call keeps every size in
// the kernel's parameter space (the view's sizes take registers: d 128 spilled 80 bytes instead of 20). kGeneral: the
// logit pipeline of flash_mask.cuh (attn_mask, window, softcap, ALiBi, dropout), causal or not at run time.
template <class Traits, bool kIsCausal, bool kPacked, bool kGeneral = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_kernel(const AttentionParams params, int heads_per_group) {
  using T = typename Traits::T;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kNThreads = Traits::kNThreads;
  extern __shared__ __align__(16) char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + Traits::QTile::kElems;  // [2] buffers
  T* sV = sK + 2 * Traits::KVTile::kElems;

  // Grid (launch_flash_fwd): without a mask (query blocks, heads, batch): the blocks of one head run side by side
  // and share its K, V in L2. Causal: one dimension in grouped_heavy_first's order (the last query block of a head
  // is its costliest). Packed sequences: batch counts sequences, and the query blocks are the longest one's.
  // General: the same grid, the last query block first.
  int m_block, bh;
  if constexpr (kIsCausal) {
    const int m_blocks = static_cast<int>((params.q_len + kBlockM - 1) / kBlockM);
    const HeadTile ht = grouped_heavy_first(blockIdx.x, static_cast<int>(params.batch * params.num_heads), m_blocks,
                                            heads_per_group);
    m_block = m_blocks - 1 - ht.tile_rank;
    bh = ht.head;
  } else {
    m_block = kGeneral ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    bh = blockIdx.z * params.num_heads + blockIdx.y;
  }
  const int64_t b = bh / params.num_heads, h = bh % params.num_heads;
  // Sequence b of packed sequences as a call of its own (its rows, lengths, causal offset); a dense call as it is.
  const AttentionParams p = kPacked ? sequence_view(params, b) : params;
  const int64_t m0 = static_cast<int64_t>(m_block) * kBlockM;
  if (kPacked && m0 >= p.q_len) return;  // a block past its sequence's end
  const int64_t hk = h / (p.num_heads / p.num_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows_valid = static_cast<int>(min64(kBlockM, p.q_len - m0));

  const T* q = head_ptr(static_cast<const T*>(p.q), p.q_strides, b, h) + m0 * p.q_strides[2];
  // A paged cache (packed sequences with block_table): k and v at the kv head's rows of page 0, each tile's rows
  // gathered through the table (copy_paged_kv_tiles_async).
  const bool paged = kPacked && p.block_table != nullptr;
  const T* k = head_ptr(static_cast<const T*>(p.k), p.k_strides, paged ? 0 : b, hk);
  const T* v = head_ptr(static_cast<const T*>(p.v), p.v_strides, paged ? 0 : b, hk);
  T* out = head_ptr(static_cast<T*>(p.out), p.out_strides, b, h) + m0 * p.out_strides[2];

  constexpr int kMi = Traits::kMi;
  // The thread's rows within the block: g and g + 8 of each of its warp's kMi m16 tiles.
  const int row0 = warp * 16 * kMi + lane / 4;

  // Keys [n_begin, n_end) are visible to some row of this block.
  int64_t n_begin = 0, n_end = p.kv_len;
  if (kIsCausal) n_end = max64(0, min64(p.kv_len, m0 + kBlockM + p.causal_offset));
  KeySpan span[kMi][2];  // kGeneral: the keys each of the thread's rows may see
  if constexpr (kGeneral) {
    int lo = INT_MAX, hi = 0;
#pragma unroll
    for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        span[mi][r] = key_span(p, b, h, m0 + row0 + mi * 16 + r * 8);
        if (span[mi][r].lo < span[mi][r].hi) {
          lo = min(lo, span[mi][r].lo);
          hi = max(hi, span[mi][r].hi);
        }
      }
    int first, end;
    block_key_range(lo, hi, &first, &end);
    n_begin = first < end ? first : 0;
    n_end = first < end ? end : 0;
  }
  const int j_begin = static_cast<int>(n_begin / kBlockN);
  const int n_tiles = static_cast<int>((n_end + kBlockN - 1) / kBlockN);  // tiles j_begin .. n_tiles - 1

  // Tr x Tc: this block is one of the Tr; it walks the Tc key tiles.
  if (j_begin < n_tiles) {
    copy_tile_async<typename Traits::QTile, kNThreads>(sQ, q, p.q_strides[2], rows_valid);
    const int64_t n1 = static_cast<int64_t>(j_begin) * kBlockN;
    const int first_keys = static_cast<int>(min64(kBlockN, p.kv_len - n1));
    copy_kv_tiles<Traits>(sK, sV, j_begin % 2, k, v, p, paged, n1, first_keys);
    cp_async_commit();
  }
  [[maybe_unused]] const Logits logits = kGeneral ? Logits(p, b, h) : Logits();
  [[maybe_unused]] const bool dropout = kGeneral && p.dropout_p > 0.f;
  [[maybe_unused]] const bool plain_logits = kGeneral && !(p.softcap > 0.f) && p.alibi_slopes == nullptr;

  // (kGeneral: the pipeline's logits are in base 2 already)
  const float scale_log2 = kGeneral ? 1.f : p.scale * kLog2e;
  float o[kMi][kD / 8][4];
  float m[kMi][2], l[kMi][2];
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) o[mi][n][0] = o[mi][n][1] = o[mi][n][2] = o[mi][n][3] = 0.f;
    m[mi][0] = m[mi][1] = -INFINITY;
    l[mi][0] = l[mi][1] = 0.f;
  }
  uint32_t q_frag[kMi][kD / 16][4];
  constexpr int kLdQ = Traits::QTile::kStride, kLdKV = Traits::KVTile::kStride;
  const T* sQw = sQ + warp * 16 * kMi * kLdQ;  // the warp's kMi x 16 query rows

  for (int j = j_begin; j < n_tiles; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // tile j is in buffer j % 2, and every warp is done with buffer (j + 1) % 2
    if constexpr (Traits::kQInRegs) if (j == j_begin) load_a_frags<T, kMi, kD, kLdQ>(q_frag, sQw, lane);
    if (j + 1 < n_tiles) {  // copy tile j + 1 while tile j is multiplied
      const int64_t n1 = static_cast<int64_t>(j + 1) * kBlockN;
      const int keys = static_cast<int>(min64(kBlockN, p.kv_len - n1));
      copy_kv_tiles<Traits>(sK, sV, (j + 1) % 2, k, v, p, paged, n1, keys);
      cp_async_commit();
    }
    const T* sKj = sK + (j % 2) * Traits::KVTile::kElems;
    const T* sVj = sV + (j % 2) * Traits::KVTile::kElems;

    // S = Q K_jᵀ (K_j's rows are Kᵀ's columns: B stored n-major)
    float s[kMi][kBlockN / 8][4];
    zero_frags(s);
    if constexpr (Traits::kQInRegs) warp_gemm_rs<T, kMi, kBlockN / 8, kD, kLdKV, false>(s, q_frag, sKj, lane);
    else warp_gemm_ss<T, kMi, kBlockN / 8, kD, kLdQ, false, kLdKV, false>(s, sQw, sKj, lane);

    const int64_t n0 = static_cast<int64_t>(j) * kBlockN;
    const bool needs_mask = n0 + kBlockN > p.kv_len || (kIsCausal && n0 + kBlockN - 1 > m0 + p.causal_offset);
    float alpha[kMi][2];
#pragma unroll
    for (int mi = 0; mi < kMi; ++mi) {
      if constexpr (kGeneral) {
        if (plain_logits && sees_whole_tile(span[mi], n0, kBlockN)) scale_tile_logits(s[mi], p);
        else tile_logits(s[mi], p, logits, span[mi], m0 + row0 + mi * 16, n0, lane);
      } else if (needs_mask)
        mask_scores<Traits, kIsCausal>(s[mi], p, m0, row0 + mi * 16, n0, lane);
      online_softmax<Traits>(s[mi], m[mi], l[mi], alpha[mi], scale_log2);
    }
    rescale_o<Traits>(o, alpha);
    if constexpr (kGeneral)
      if (dropout) {  // P V with the dropped P; l keeps the undropped sum
        const Dropout z(p, b, h);
#pragma unroll
        for (int mi = 0; mi < kMi; ++mi) tile_dropout(s[mi], p, z, m0 + row0 + mi * 16, n0, lane);
      }
    // O += P V_j: P rounded to T at once (its float C fragments die here, which frees registers for the
    // product); V_j is (key, d) row-major, so B = V_j is stored k-major.
    uint32_t p_frag[kMi][kBlockN / 16][4];
    c_to_a_frags<T>(p_frag, s);
    warp_gemm_rs<T, kMi, kD / 8, kBlockN, kLdKV, true>(o, p_frag, sVj, lane);
  }

  // O /= l, written in T; lse = scale·m + log l (−inf, and O = 0, for a row that saw no key).
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float row_l = quad_sum(l[mi][r]);
      const float inv_l = row_l == 0.f ? 0.f : 1.f / row_l;  // NaN l (a NaN or +inf logit): the row NaN
      const int row = row0 + mi * 16 + r * 8;
      if (row < rows_valid) {
        T* out_row = out + row * p.out_strides[2];
#pragma unroll
        for (int n = 0; n < kD / 8; ++n)
          *reinterpret_cast<uint32_t*>(out_row + n * 8 + (lane % 4) * 2) =
              pack2<T>(o[mi][n][2 * r] * inv_l, o[mi][n][2 * r + 1] * inv_l);
        if (p.lse != nullptr && lane % 4 == 0)
          p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + m0 + row] =
              row_l == 0.f ? -INFINITY : m[mi][r] * (kGeneral ? kLn2 : p.scale) + logf(row_l);
      }
    }
}

template <class Traits>
cudaError_t launch_flash_fwd(const AttentionParams& p, cudaStream_t stream) {
  const unsigned m_blocks = static_cast<unsigned>((p.q_len + Traits::kBlockM - 1) / Traits::kBlockM);
  const unsigned heads = static_cast<unsigned>(p.batch * p.num_heads);
  if (heads == 0 || m_blocks == 0) return cudaSuccess;  // no query rows: nothing to write
  const dim3 grid = p.is_causal ? dim3(heads * m_blocks)
                                : dim3(m_blocks, static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch));
  const bool packed = p.cu_seqlens_q != nullptr;
  auto kernel = p.is_causal ? (packed ? flash_fwd_kernel<Traits, true, true> : flash_fwd_kernel<Traits, true, false>)
                            : (packed ? flash_fwd_kernel<Traits, false, true> : flash_fwd_kernel<Traits, false, false>);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  int heads_per_group = 1;
  if (p.is_causal) err = group_heads(kernel, Traits::kNThreads, Traits::kSmemBytes, m_blocks, &heads_per_group);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(p, heads_per_group);
  return cudaGetLastError();
}

// The general kernel (attn_mask, window, softcap, ALiBi, dropout): one instantiation per configuration it is
// launched with (dense and packed), causal or not at run time.
template <class Traits>
cudaError_t launch_flash_fwd_general(const AttentionParams& p, cudaStream_t stream) {
  const unsigned m_blocks = static_cast<unsigned>((p.q_len + Traits::kBlockM - 1) / Traits::kBlockM);
  const unsigned heads = static_cast<unsigned>(p.batch * p.num_heads);
  if (heads == 0 || m_blocks == 0) return cudaSuccess;
  // Packed sequences: each block takes its sequence's view (sequence_view: lengths, offsets, dropout's numbering).
  auto kernel = p.cu_seqlens_q != nullptr ? flash_fwd_kernel<Traits, false, true, true>
                                          : flash_fwd_kernel<Traits, false, false, true>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(m_blocks, static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch));
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(p, 1);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace cs149gpt
