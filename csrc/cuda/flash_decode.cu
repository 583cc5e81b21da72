// Flash-decoding on the GPU: a few query rows (the tokens being generated) against a long KV cache.
//
// Decoding is bound by memory: every step reads the whole cache once and does little arithmetic per key (a GQA group
// of 4 query heads at q_len 1 is 4 rows: 4 multiply-adds per element read). So the kernel is laid out to stream K and V
// once at full bandwidth, as the CPU's flash_decode.cpp does:
// - a block holds R query rows of one (batch, kv head): rows ρ = i·G + g (query position i, head g of the GQA group of
//   G = Hq / Hkv), so every query head of a group reads each key and value once, from the same registers;
// - lanes read keys with 16-byte loads, kLanes lanes per key row (d = 128 in bf16: 16 lanes, two keys per warp-load),
//   kGroups key groups side by side, kUnroll keys each in flight before any is used: a block has
//   kGroups · kUnroll keys of K and V loading at once (32 KB at d = 128, bf16, R <= 4), the next step's prefetched
//   into L2 meanwhile;
// - the keys of a sequence are split over gridDim.y blocks (split-KV, FlashDecoding): each split runs the online
//   softmax over its keys and writes its partial (O_s, m_s, l_s); decode_combine merges them exactly:
//     M = max_s m_s,   l = Σ_s 2^(m_s − M) l_s,   O = Σ_s 2^(m_s − M) O_s / l,   lse = (M + log2 l) · ln 2.
//   Inside a block the key groups are merged the same way, through shared memory.
// Each key group runs the online softmax of its own keys (flash_common.h's, in base 2):
//   s_j = log2(e) · c(scale · q·k_j),  m' = max(m, max_j s_j),  α = 2^(m − m'),  l = α·l + Σ_j 2^(s_j − m'),
//   O = α·O + Σ_j 2^(s_j − m') v_j          (c: softcap and ALiBi where the call has them)
// The cache is read by address in place: cache_seqlens, cache_leftpad, cache_batch_idx and block_table are read on
// the device, never on the host (no synchronisation in a decoding step). Every index taken from them is clamped into
// the cache, so a bad entry can give a wrong answer but never reads or writes outside it (the CPU op refuses such entries
// before reading; here that would cost a copy to the host and a synchronisation per step).
// Non-finite values follow the CPU's rule (README): a NaN or +inf logit makes its row NaN, −inf logits weigh 0, NaN in
// a visible value row shows even where its weight is 0, and a key the causal mask or the window hides from a row never
// touches that row (its value is not multiplied in, not even by 0).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "flash_common.cuh"
#include "flash_cuda.h"

namespace cs149gpt {
namespace cuda {
namespace decode {

constexpr float kNegInf = -INFINITY;

// The tile configuration of one (head dim, dtype, rows) instance.
template <int D, class T, int R>
struct Traits {
  static constexpr int kThreads = kDecodeThreads;
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
  static constexpr int kLanes = D / kVec;                         // lanes that hold one key row
  static constexpr int kGroups = kThreads / kLanes;               // keys read side by side
  // Keys per group per step (2 · kUnroll 16-byte loads in flight per lane); fewer for 8 rows, whose q and O rows
  // take the registers.
  static constexpr int kUnroll = R <= 4 ? 8 : 4;
  static constexpr int kStepKeys = kGroups * kUnroll;
  static_assert(kLanes >= 1 && kLanes <= 32 && 32 % kLanes == 0, "a key row within one warp");
};

// ---- element conversions ----------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// 16 bytes of T as floats.
template <class T, int kVec>
__device__ __forceinline__ void unpack16(const uint4& raw, float (&x)[kVec]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int c = 0; c < kVec; ++c) x[c] = to_float(e[c]);
}

// Asks L2 for the 128-byte line at p (no register written; a later load finds it there).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// A max that keeps NaN (fmaxf drops it): a NaN logit must turn its row NaN, as on the CPU.
__device__ __forceinline__ float max_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// ---- the sequences of a cache -----------------------------------------------------------------------
// Sequence b of the call: `cached` rows in its cache before the append, its keys starting at row `leftpad`, `len`
// keys in all (appended ones included, counted from leftpad), in cache row `row` (contiguous caches). Clamped into
// the cache (cached <= capacity − new_len, leftpad <= cached, row < cache_rows).
struct Sequence {
  int cached, leftpad, len;
  int64_t row;
};
__device__ __forceinline__ Sequence sequence_of(const DecodeParams& dp, int b) {
  const AttentionParams& p = dp.p;
  const int64_t stored = p.cache_seqlens_int64 ? static_cast<const int64_t*>(p.cache_seqlens)[b]
                                               : static_cast<const int32_t*>(p.cache_seqlens)[b];
  const int cached = static_cast<int>(min64(max64(stored, 0), dp.capacity - p.new_len));
  const int leftpad = p.cache_leftpad ? min(max(p.cache_leftpad[b], 0), cached) : 0;
  const int64_t row = p.cache_batch_idx ? min64(max64(p.cache_batch_idx[b], 0), dp.cache_rows - 1) : b;
  return {cached, leftpad, cached + static_cast<int>(p.new_len) - leftpad, row};
}

// Cache row t (counted from row 0, not from leftpad) of kv head kvh of sequence b: a row of its contiguous cache, or
// row t % page_size of page block_table[b, t / page_size] (clamped to the pages there are).
template <class T>
__device__ __forceinline__ T* cache_row(const DecodeParams& dp, const void* base, const int64_t (&strides)[3], int b,
                                        const Sequence& s, int kvh, int t) {
  const AttentionParams& p = dp.p;
  T* at = const_cast<T*>(static_cast<const T*>(base)) + kvh * strides[1];
  if (!p.block_table) return at + s.row * strides[0] + static_cast<int64_t>(t) * strides[2];
  const uint32_t page_size = static_cast<uint32_t>(p.page_size), row = static_cast<uint32_t>(t);
  const uint32_t block = dp.page_shift >= 0 ? row >> dp.page_shift : row / page_size;
  const uint32_t within = dp.page_shift >= 0 ? row & (page_size - 1) : row % page_size;
  const int32_t entry = p.block_table[b * p.block_table_stride + block];
  const int64_t page = min64(max64(entry, 0), p.num_pages - 1);
  return at + page * strides[0] + static_cast<int64_t>(within) * strides[2];
}

// ---- appending k_new, v_new -------------------------------------------------------------------------
// One thread per 16 bytes of a new row: k_new and v_new of (batch b, kv head, row t) go to cache row cached_b + t.
template <int D, class T>
__global__ void append_kernel(const DecodeParams dp) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T)), kLanes = D / kVec;
  const AttentionParams& p = dp.p;
  const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t rows = p.batch * p.num_kv_heads * p.new_len;
  if (id >= rows * kLanes) return;
  const int col = static_cast<int>(id % kLanes) * kVec;
  const int64_t r = id / kLanes, t = r % p.new_len, bk = r / p.new_len;
  const int b = static_cast<int>(bk / p.num_kv_heads), kvh = static_cast<int>(bk % p.num_kv_heads);
  const Sequence s = sequence_of(dp, b);
  const int at = s.cached + static_cast<int>(t);
  const T* kn = static_cast<const T*>(p.k_new) + b * p.k_new_strides[0] + kvh * p.k_new_strides[1] +
                t * p.k_new_strides[2] + col;
  const T* vn = static_cast<const T*>(p.v_new) + b * p.v_new_strides[0] + kvh * p.v_new_strides[1] +
                t * p.v_new_strides[2] + col;
  *reinterpret_cast<uint4*>(cache_row<T>(dp, p.k, p.k_strides, b, s, kvh, at) + col) =
      *reinterpret_cast<const uint4*>(kn);
  *reinterpret_cast<uint4*>(cache_row<T>(dp, p.v, p.v_strides, b, s, kvh, at) + col) =
      *reinterpret_cast<const uint4*>(vn);
}

// ---- the rows of a block ----------------------------------------------------------------------------
// Row ρ of (batch b, kv head kvh): query position i = ρ / G of head kvh·G + ρ % G. It sees keys [lo, hi) (counted from
// leftpad): causal and the window bottom-right aligned to the sequence's len keys (offset len − q_len).
struct Row {
  int lo, hi;      // empty when hi <= lo (and for the padding rows of the last tile)
  int head, pos;   // query head and position
  float slope;     // ALiBi's, in log2 units; 0 without
  int diag;        // ALiBi: key j is at distance |diag − j| from the row's diagonal
};
__device__ __forceinline__ Row row_of(const DecodeParams& dp, int b, int kvh, int rho, int len) {
  const AttentionParams& p = dp.p;
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  Row r{0, 0, 0, 0, 0.0f, 0};
  if (rho >= group * p.q_len) return r;
  r.pos = rho / group;
  r.head = kvh * group + rho % group;
  const int64_t diag = r.pos + static_cast<int64_t>(len) - p.q_len;  // the last key causal attention shows
  int64_t lo = 0, hi = len;
  if (p.is_causal) hi = min64(hi, diag + 1);
  if (p.window_right >= 0) hi = min64(hi, diag + p.window_right + 1);
  if (p.window_left >= 0) lo = max64(lo, diag - p.window_left);
  r.lo = static_cast<int>(min64(lo, len));
  r.hi = static_cast<int>(max64(hi, r.lo));
  r.diag = static_cast<int>(diag);
  if (p.alibi_slopes) r.slope = kLog2e * p.alibi_slopes[b * p.alibi_strides[0] + r.head * p.alibi_strides[1]];
  return r;
}

// s = log2(e) · c(scale · qk) for key j of row r: softcap · tanh(scale · qk / softcap), then −slope · |diag − j|.
__device__ __forceinline__ float logit(const AttentionParams& p, float qk, const Row& r, int j) {
  float s = p.softcap > 0.0f ? kLog2e * p.softcap * tanhf(qk * (p.scale / p.softcap)) : qk * (p.scale * kLog2e);
  if (p.alibi_slopes) s -= r.slope * fabsf(static_cast<float>(r.diag - j));
  return s;
}

// ---- one split of one (batch, kv head, row tile) --------------------------------------------------------
// Grid: x = (batch · Hkv) · row tiles, y = the splits. Writes out and lse (one split), or the split's partials.
template <int D, class T, int R>
__global__ void __launch_bounds__(kDecodeThreads) split_kernel(const DecodeParams dp) {
  using Tr = Traits<D, T, R>;
  constexpr int kVec = Tr::kVec, kLanes = Tr::kLanes, kGroups = Tr::kGroups, kUnroll = Tr::kUnroll;
  const AttentionParams& p = dp.p;
  const int row_tiles = dp.row_tiles;
  const int bk = blockIdx.x / row_tiles, tile = blockIdx.x % row_tiles, split = blockIdx.y;
  const int b = static_cast<int>(bk / p.num_kv_heads), kvh = static_cast<int>(bk % p.num_kv_heads);
  const int rows_total = static_cast<int>(p.num_heads / p.num_kv_heads * p.q_len);
  const int rho0 = tile * R;
  const int lane = threadIdx.x % kLanes, group = threadIdx.x / kLanes, col = lane * kVec;
  const Sequence seq = sequence_of(dp, b);

  // The rows: their q (this lane's kVec columns, float32), the keys they see. The block reads the union of their keys.
  Row rows[R];
  float q[R][kVec];
  int k_lo = seq.len, k_hi = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    rows[r] = row_of(dp, b, kvh, rho0 + r, seq.len);
    if (rows[r].hi > rows[r].lo) {
      k_lo = min(k_lo, rows[r].lo);
      k_hi = max(k_hi, rows[r].hi);
    }
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (rho0 + r < rows_total)
      raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + b * p.q_strides[0] +
                                            rows[r].head * p.q_strides[1] + rows[r].pos * p.q_strides[2] + col);
    unpack16<T, kVec>(raw, q[r]);
  }
  // This split's share of them: an equal part, at least kDecodeMinSplitKeys (short sequences use fewer splits; the
  // others write empty partials).
  const int span = max(k_hi - k_lo, 0), splits = gridDim.y;
  const int chunk = max((span + splits - 1) / splits, kDecodeMinSplitKeys);
  const int k_begin = k_lo + static_cast<int>(min64(span, static_cast<int64_t>(split) * chunk));
  const int k_end = k_lo + static_cast<int>(min64(span, static_cast<int64_t>(split + 1) * chunk));

  float m[R], l[R], o[R][kVec];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = kNegInf;
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < kVec; ++c) o[r][c] = 0.0f;
  }

  for (int base = k_begin; base < k_end; base += Tr::kStepKeys) {
    // Every load of the step first (2 · kUnroll 16-byte loads in flight per lane), then the arithmetic.
    uint4 kraw[kUnroll], vraw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kGroups + group;
      kraw[u] = vraw[u] = make_uint4(0, 0, 0, 0);
      if (j < k_end) {
        const int t = seq.leftpad + j;
        kraw[u] = __ldg(reinterpret_cast<const uint4*>(cache_row<const T>(dp, p.k, p.k_strides, b, seq, kvh, t) + col));
        vraw[u] = __ldg(reinterpret_cast<const uint4*>(cache_row<const T>(dp, p.v, p.v_strides, b, seq, kvh, t) + col));
      }
    }
    // The next step's keys into L2 while this one is worked on (a lane per 128-byte line), as the CPU kernel prefetches
    // its next block: the loads of the next step then wait on L2, not on memory.
    if (col * static_cast<int>(sizeof(T)) % 128 == 0) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = base + Tr::kStepKeys + u * kGroups + group;
        if (j < k_end) {
          const int t = seq.leftpad + j;
          prefetch_l2(cache_row<const T>(dp, p.k, p.k_strides, b, seq, kvh, t) + col);
          prefetch_l2(cache_row<const T>(dp, p.v, p.v_strides, b, seq, kvh, t) + col);
        }
      }
    }
    // S = Q Kᵀ: this lane's kVec products, summed over the key's kLanes lanes (a butterfly: every lane gets the sum).
    float s[R][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float k[kVec];
      unpack16<T, kVec>(kraw[u], k);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float acc = 0.0f;
#pragma unroll
        for (int c = 0; c < kVec; ++c) acc = fmaf(q[r][c], k[c], acc);
        s[r][u] = acc;
      }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) s[r][u] += __shfl_xor_sync(0xffffffffu, s[r][u], offset);

    // The online softmax, row by row; a key the row does not see is −inf and its value is never multiplied in.
#pragma unroll
    for (int r = 0; r < R; ++r) {
      uint32_t seen = 0;
      float mx = kNegInf;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = base + u * kGroups + group;
        const bool visible = j < k_end && j >= rows[r].lo && j < rows[r].hi;
        seen |= static_cast<uint32_t>(visible) << u;
        s[r][u] = visible ? logit(p, s[r][u], rows[r], j) : kNegInf;
        mx = max_nan(mx, s[r][u]);
      }
      if (!seen) continue;
      const float m_new = max_nan(m[r], mx);
      // All −inf so far: weights 0, α 1 (the CPU's rule); else α = 2^(m − m'), 0 on a first block.
      const float alpha = m_new == kNegInf ? 1.0f : exp2f(m[r] - m_new);
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kVec; ++c) o[r][c] *= alpha;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (!(seen >> u & 1u)) continue;
        const float w = m_new == kNegInf ? 0.0f : exp2f(s[r][u] - m_new);
        sum += w;
        float v[kVec];
        unpack16<T, kVec>(vraw[u], v);
#pragma unroll
        for (int c = 0; c < kVec; ++c) o[r][c] = fmaf(w, v[c], o[r][c]);
      }
      l[r] = fmaf(alpha, l[r], sum);
      m[r] = m_new;
    }
  }

  // The key groups' partials, merged through shared memory (the same merge as the splits').
  __shared__ float sm_o[kGroups][R][D];
  __shared__ float sm_m[kGroups][R], sm_l[kGroups][R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int c = 0; c < kVec; ++c) sm_o[group][r][col + c] = o[r][c];
    if (lane == 0) {
      sm_m[group][r] = m[r];
      sm_l[group][r] = l[r];
    }
  }
  __syncthreads();
  const bool one_split = gridDim.y == 1;
  for (int idx = threadIdx.x; idx < R * D; idx += kDecodeThreads) {
    const int r = idx / D, c = idx % D, rho = rho0 + r;
    if (rho >= rows_total) break;
    float M = kNegInf;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) M = max_nan(M, sm_m[g][r]);
    float L = 0.0f, O = 0.0f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const float w = M == kNegInf ? 0.0f : exp2f(sm_m[g][r] - M);  // even when 0: a NaN in O_g must show
      L = fmaf(w, sm_l[g][r], L);
      O = fmaf(w, sm_o[g][r][c], O);
    }
    if (one_split) {
      const int group_size = static_cast<int>(p.num_heads / p.num_kv_heads);
      const int h = kvh * group_size + rho % group_size, i = rho / group_size;
      T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + h * p.out_strides[1] + i * p.out_strides[2];
      out[c] = from_float<T>(O * (L == 0.0f ? 0.0f : 1.0f / L));
      if (c == 0 && p.lse)
        p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i] = L == 0.0f ? kNegInf : (M + log2f(L)) * kLn2;
    } else {
      const int64_t at = (static_cast<int64_t>(bk) * gridDim.y + split) * rows_total + rho;
      dp.part_o[at * D + c] = O;
      if (c == 0) {
        dp.part_ml[2 * at] = M;
        dp.part_ml[2 * at + 1] = L;
      }
    }
  }
}

// ---- the merge of the splits ------------------------------------------------------------------------
// One warp per output row (batch, kv head, ρ): the splits' partials in split order, out = O / l, lse.
template <int D, class T>
__global__ void __launch_bounds__(kDecodeThreads) combine_kernel(const DecodeParams dp) {
  constexpr int kCols = D / 32;  // columns per lane: c = lane + 32·k, coalesced
  const AttentionParams& p = dp.p;
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int rows_total = static_cast<int>(group * p.q_len);
  const int64_t id = static_cast<int64_t>(blockIdx.x) * (kDecodeThreads / 32) + threadIdx.x / 32;
  if (id >= p.batch * p.num_kv_heads * rows_total) return;
  const int lane = threadIdx.x % 32, splits = dp.splits;
  const int rho = static_cast<int>(id % rows_total);
  const int64_t bk = id / rows_total;
  const int b = static_cast<int>(bk / p.num_kv_heads), kvh = static_cast<int>(bk % p.num_kv_heads);
  const float* ml = dp.part_ml + 2 * (bk * splits * rows_total + rho);
  const float* po = dp.part_o + (bk * splits * rows_total + rho) * D;
  const int64_t split_stride = static_cast<int64_t>(rows_total);
  float M = kNegInf;
  for (int s = 0; s < splits; ++s) M = max_nan(M, ml[2 * s * split_stride]);
  float L = 0.0f, O[kCols];
#pragma unroll
  for (int k = 0; k < kCols; ++k) O[k] = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float w = M == kNegInf ? 0.0f : exp2f(ml[2 * s * split_stride] - M);
    L = fmaf(w, ml[2 * s * split_stride + 1], L);
#pragma unroll
    for (int k = 0; k < kCols; ++k) O[k] = fmaf(w, po[s * split_stride * D + lane + 32 * k], O[k]);
  }
  const int h = kvh * group + rho % group, i = rho / group;
  T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + h * p.out_strides[1] + i * p.out_strides[2];
  const float inv_l = L == 0.0f ? 0.0f : 1.0f / L;
#pragma unroll
  for (int k = 0; k < kCols; ++k) out[lane + 32 * k] = from_float<T>(O[k] * inv_l);
  if (lane == 0 && p.lse)
    p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i] = L == 0.0f ? kNegInf : (M + log2f(L)) * kLn2;
}

template <int D, class T, int R>
cudaError_t launch_split(const DecodeParams& dp, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(dp.p.batch * dp.p.num_kv_heads * dp.row_tiles), dp.splits);
  split_kernel<D, T, R><<<grid, kDecodeThreads, 0, stream>>>(dp);
  return cudaGetLastError();
}

template <int D, class T>
cudaError_t run(const DecodeParams& dp, cudaStream_t stream) {
  const AttentionParams& p = dp.p;
  if (p.k_new && p.new_len > 0) {
    constexpr int kLanes = D / (16 / static_cast<int>(sizeof(T)));
    const int64_t threads = p.batch * p.num_kv_heads * p.new_len * kLanes;
    append_kernel<D, T><<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(dp);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  cudaError_t err = cudaErrorInvalidValue;
  switch (dp.rows_per_block) {
    case 1: err = launch_split<D, T, 1>(dp, stream); break;
    case 2: err = launch_split<D, T, 2>(dp, stream); break;
    case 4: err = launch_split<D, T, 4>(dp, stream); break;
    case 8: err = launch_split<D, T, 8>(dp, stream); break;
  }
  if (err != cudaSuccess || dp.splits == 1) return err;
  const int64_t rows = p.batch * p.num_kv_heads * (p.num_heads / p.num_kv_heads) * p.q_len;
  constexpr int kWarps = kDecodeThreads / 32;
  combine_kernel<D, T><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kDecodeThreads, 0, stream>>>(dp);
  return cudaGetLastError();
}

template <class T>
cudaError_t run_dtype(const DecodeParams& dp, cudaStream_t stream) {
  switch (dp.p.head_dim) {
    case 64: return run<64, T>(dp, stream);
    case 128: return run<128, T>(dp, stream);
    default: return cudaErrorInvalidValue;  // flash_api.cpp refuses other head dims first
  }
}

}  // namespace decode

// ---- the heuristics ---------------------------------------------------------------------------------
int decode_rows_per_block(const AttentionParams& p) {
  const int64_t rows = p.num_heads / p.num_kv_heads * p.q_len;
  return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : kDecodeMaxRowsPerBlock;
}

int decode_splits(const AttentionParams& p, int64_t capacity, int rows_per_block, int sms) {
  const int64_t row_tiles = (p.num_heads / p.num_kv_heads * p.q_len + rows_per_block - 1) / rows_per_block;
  const int64_t blocks = p.batch * p.num_kv_heads * row_tiles;
  if (blocks <= 0) return 1;
  // Blocks for kDecodeBlocksPerSm per SM, each split at least kDecodeMinSplitKeys keys of the cache's capacity.
  const int64_t wanted = (static_cast<int64_t>(kDecodeBlocksPerSm) * sms + blocks - 1) / blocks;
  const int64_t most = (capacity + kDecodeMinSplitKeys - 1) / kDecodeMinSplitKeys;
  const int64_t splits = wanted < most ? wanted : most;
  return static_cast<int>(splits < 1 ? 1 : splits > kDecodeMaxSplits ? kDecodeMaxSplits : splits);
}

cudaError_t flash_decode(const DecodeParams& dp, cudaStream_t stream) {
  switch (dp.p.dtype) {
    case DType::bf16: return decode::run_dtype<__nv_bfloat16>(dp, stream);
    case DType::f16: return decode::run_dtype<__half>(dp, stream);
    case DType::f32: return decode::run_dtype<float>(dp, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace cs149gpt
