// Flash-decoding on the GPU: a few query rows (the tokens being generated) against a long KV cache.
//
// Decoding is bound by memory: every step reads the whole cache once and does little arithmetic per key (a GQA group
// of 4 query heads at q_len 1 is 4 rows: 4 multiply-adds per element read). So the kernel streams K and V once, as
// FlashAttention-2's split-KV ("flash-decoding") forward does, on tensor cores (bf16/fp16):
// - a block holds one m16 row tile of one (batch, kv head): rows ρ = i·G + g (query position i, head g of the GQA
//   group of G = Hq / Hkv), padded with empty rows to 16, so every query head of a group reads each key and value once
//   (G·q_len > 16: more row tiles, each reading the keys again);
// - the keys of a sequence are split over gridDim.y blocks (split-KV): each split runs the online softmax over its keys
//   and writes its partial (O_s, m_s, l_s); combine_kernel merges them exactly:
//     M = max_s m_s,   l = Σ_s 2^(m_s − M) l_s,   O = Σ_s 2^(m_s − M) O_s / l,   lse = (M + log2 l) · ln 2;
// - a split's keys stream through shared memory in tiles of kDecodeBlockKeys, K and V copied by 16-byte cp.async into
//   a ring of kDecodeStages tiles: kDecodeStages − 1 tiles are in flight while one is used (memory latency hidden by
//   bytes in flight, Little's law), one __syncthreads a tile;
// - each of the 4 warps takes a 16-key slice of every tile: S = Q Kᵀ (16 x 16, mma.sync m16n8k16; Q's A fragments in
//   registers for the whole split, K by ldmatrix), then the logit pipeline and the online softmax on S's C fragments
//   (each (row, key) on one lane, row max and sum over the 4 lanes of a quad), then O += P V (P's A fragments are S's C
//   fragments, V by ldmatrix.trans; O in float32 C fragments);
// - at the end the 4 warps' (m, l, O) are merged through shared memory, the same merge as the splits'.
// Each warp runs the online softmax of its own keys (csrc/kernels/flash_common.h's, in base 2):
//   s_j = log2(e) · c(scale · q·k_j),  m' = max(m, max_j s_j),  α = 2^(m − m'),  l = α·l + Σ_j 2^(s_j − m'),
//   O = α·O + Σ_j 2^(s_j − m') v_j          (c: softcap and ALiBi where the call has them)
// float32 has no mma: its calls run the scalar kernel below (lanes of 16-byte loads per key row, several rows a block).
// The cache is read by address in place: cache_seqlens, cache_leftpad, cache_batch_idx and block_table are read on
// the device, never on the host (no synchronisation in a decoding step). Every index taken from them is clamped into
// the cache, so a bad entry can give a wrong answer but never reads or writes outside it (the CPU op refuses such entries
// before reading; here that would cost a copy to the host and a synchronisation per step).
// Non-finite values follow the CPU's rule (README): a NaN or +inf logit makes its row NaN, −inf logits weigh 0, NaN in
// a visible value row shows even where its weight is 0, and a key the causal mask or the window hides from a row never
// touches that row (its value is not multiplied in, not even by 0). P V on tensor cores multiplies every key of a slice
// into every row, a hidden one by P = 0: so in a slice where some row hides a key (the causal diagonal at q_len > 1,
// window edges, rows that see nothing) whose value row holds a NaN or inf, that slice's P V runs per lane instead,
// skipping each row's hidden keys. Keys past the split's end are copied as zeros and weigh 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "flash_common.cuh"
#include "flash_cuda.h"
#include "kernel_traits.cuh"
#include "warp_gemm.cuh"

namespace cs149gpt {
namespace cuda {
namespace decode {

constexpr float kNegInf = -INFINITY;

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

// Whether either 16-bit value of a register is NaN or ±inf (its exponent bits all set).
template <class T> __device__ __forceinline__ bool nonfinite2(uint32_t x);
template <> __device__ __forceinline__ bool nonfinite2<__nv_bfloat16>(uint32_t x) {
  return (x & 0x7f80u) == 0x7f80u || (x & 0x7f800000u) == 0x7f800000u;
}
template <> __device__ __forceinline__ bool nonfinite2<__half>(uint32_t x) {
  return (x & 0x7c00u) == 0x7c00u || (x & 0x7c000000u) == 0x7c000000u;
}

// Asks L2 for the 128-byte line at p (no register written; a later load finds it there).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Programmatic dependent launch (sm_90+; no-ops below, and in a grid launched without it): a split block lets the
// merge's grid launch once its own loads are done, and the merge waits for every split block's partials before
// reading them. The merge's launch then overlaps the splits' tail: 6 % of a step at B 1, 8192 keys (H200).
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

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

// Where cache row t (counted from row 0, not from leftpad) of sequence b lies: row `within` of the cache's dim-0 entry
// `outer`, its contiguous cache row, or page block_table[b, t / page_size] (clamped to the pages there are) at row
// t % page_size. K and V share it (one block-table read for both).
struct CacheSlot {
  int64_t outer, within;
};
__device__ __forceinline__ CacheSlot cache_slot(const DecodeParams& dp, int b, const Sequence& s, int t) {
  const AttentionParams& p = dp.p;
  if (!p.block_table) return {s.row, t};
  const uint32_t page_size = static_cast<uint32_t>(p.page_size), row = static_cast<uint32_t>(t);
  const uint32_t block = dp.page_shift >= 0 ? row >> dp.page_shift : row / page_size;
  const uint32_t within = dp.page_shift >= 0 ? row & (page_size - 1) : row % page_size;
  const int32_t entry = p.block_table[b * p.block_table_stride + block];
  return {min64(max64(entry, 0), p.num_pages - 1), within};
}
template <class T>
__device__ __forceinline__ T* at_slot(const void* head, const int64_t (&strides)[3], const CacheSlot& at) {
  return const_cast<T*>(static_cast<const T*>(head)) + at.outer * strides[0] + at.within * strides[2];
}

// Cache row t of kv head kvh of sequence b.
template <class T>
__device__ __forceinline__ T* cache_row(const DecodeParams& dp, const void* base, const int64_t (&strides)[3], int b,
                                        const Sequence& s, int kvh, int t) {
  const CacheSlot at = cache_slot(dp, b, s, t);
  return const_cast<T*>(static_cast<const T*>(base)) + kvh * strides[1] + at.outer * strides[0] +
         at.within * strides[2];
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

// ---- what both split kernels share ------------------------------------------------------------------
// The keys [begin, end) of split `split` of `splits` over the rows' keys [k_lo, k_hi): an equal part, at least
// kDecodeMinSplitKeys and a multiple of `multiple` (short sequences use fewer splits; the others write empty partials).
struct KeyRange {
  int begin, end;
};
__device__ __forceinline__ KeyRange split_keys(int k_lo, int k_hi, int split, int splits, int multiple) {
  const int64_t span = max(k_hi - k_lo, 0);
  const int64_t chunk =
      (max64((span + splits - 1) / splits, kDecodeMinSplitKeys) + multiple - 1) / multiple * multiple;
  return {k_lo + static_cast<int>(min64(span, static_cast<int64_t>(split) * chunk)),
          k_lo + static_cast<int>(min64(span, static_cast<int64_t>(split + 1) * chunk))};
}

// Merges kParts partials (O_g, m_g, l_g) of rows rho0 .. rho0 + kRows − 1, held in shared memory (o: [part][row]
// [kOStride], m, l: [part][row]), the same merge as the splits', and writes out and lse (one split) or the split's
// partial. Called by the whole block after a __syncthreads.
template <int D, class T, int kRows, int kParts, int kOStride>
__device__ __forceinline__ void merge_parts_and_write(const DecodeParams& dp, const float* sm_o, const float* sm_m,
                                                      const float* sm_l, int b, int kvh, int bk, int rho0) {
  const AttentionParams& p = dp.p;
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int rows_total = static_cast<int>(group * p.q_len);
  const bool one_split = gridDim.y == 1;
  for (int idx = threadIdx.x; idx < kRows * D; idx += kDecodeThreads) {
    const int r = idx / D, c = idx % D, rho = rho0 + r;
    if (rho >= rows_total) break;
    float M = kNegInf;
#pragma unroll
    for (int g = 0; g < kParts; ++g) M = max_nan(M, sm_m[g * kRows + r]);
    float L = 0.0f, O = 0.0f;
#pragma unroll
    for (int g = 0; g < kParts; ++g) {
      const float w = M == kNegInf ? 0.0f : exp2f(sm_m[g * kRows + r] - M);  // even when 0: a NaN in O_g must show
      L = fmaf(w, sm_l[g * kRows + r], L);
      O = fmaf(w, sm_o[(g * kRows + r) * kOStride + c], O);
    }
    if (one_split) {
      const int h = kvh * group + rho % group, i = rho / group;
      T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + h * p.out_strides[1] + i * p.out_strides[2];
      out[c] = from_float<T>(O * (L == 0.0f ? 0.0f : 1.0f / L));
      if (c == 0 && p.lse)
        p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i] = L == 0.0f ? kNegInf : (M + log2f(L)) * kLn2;
    } else {
      const int64_t at = (static_cast<int64_t>(bk) * gridDim.y + blockIdx.y) * rows_total + rho;
      dp.part_o[at * D + c] = O;
      if (c == 0) {
        dp.part_ml[2 * at] = M;
        dp.part_ml[2 * at + 1] = L;
      }
    }
  }
}

// ---- one split of one (batch, kv head, row tile), on tensor cores (bf16, fp16) ---------------------------
// The tile configuration of one (head dim, dtype): a block of kWarps warps over one m16 row tile, key tiles of
// kBlockKeys (kWarpKeys a warp) in a ring of kStages, Q's 16 rows staged once in shared memory.
template <int D, class T, int kStages_ = kDecodeStages>
struct Traits {
  static constexpr int kThreads = kDecodeThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kRows = kDecodeTileRows;
  static constexpr int kBlockKeys = kDecodeBlockKeys;
  static constexpr int kWarpKeys = kBlockKeys / kWarps;
  static constexpr int kStages = kStages_;
  using QTile = SmemTile<kRows, D, T>;
  using KVTile = SmemTile<kBlockKeys, D, T>;
  static constexpr int kSmemBytes = QTile::kBytes + 2 * kStages * KVTile::kBytes;  // Q, K[kStages], V[kStages]
  // The warps' partials at the end, over the ring: O rows padded by 8 floats (the 8 rows a quad column writes at once
  // fall in different banks).
  static constexpr int kOStride = D + 8;
  static constexpr int kMergeBytes = (kWarps * kRows * kOStride + 2 * kWarps * kRows) * static_cast<int>(sizeof(float));
  static_assert(kRows == 16 && kWarpKeys == 16, "a warp's slice is one m16n8k16 product: 16 rows x 16 keys");
  static_assert(kMergeBytes <= kSmemBytes, "the merge reuses the ring");
  static_assert(kThreads % (D / 8) == 0 && kBlockKeys % (kThreads / (D / 8)) == 0, "every thread copies alike");
};

// Copies keys [j0, j0 + kBlockKeys) of K and V (row `leftpad + j` of the cache; zeros from k_end on) into one stage of
// the ring, asynchronously. Each thread keeps one 16-byte column chunk and walks rows kThreads / (D / 8) apart.
// kPaged: every row's page is looked up in the block table. Else a whole tile is one pointer stepped by the row stride
// (each row's own 64-bit address arithmetic was half of the split kernel's instructions).
template <class Tr, int D, bool kPaged, class T>
__device__ __forceinline__ void copy_kv_tile_async(T* sK, T* sV, const DecodeParams& dp, const T* k_head,
                                                   const T* v_head, int b, const Sequence& seq, int j0, int k_end) {
  constexpr int kChunks = D / 8, kRowsPerPass = Tr::kThreads / kChunks;
  const AttentionParams& p = dp.p;
  const int r0 = threadIdx.x / kChunks, col = (threadIdx.x % kChunks) * 8;
  if (!kPaged && j0 + Tr::kBlockKeys <= k_end) {
    const int64_t t0 = seq.leftpad + j0 + r0;
    const T* k = k_head + seq.row * p.k_strides[0] + t0 * p.k_strides[2] + col;
    const T* v = v_head + seq.row * p.v_strides[0] + t0 * p.v_strides[2] + col;
    const int64_t k_step = kRowsPerPass * p.k_strides[2], v_step = kRowsPerPass * p.v_strides[2];
#pragma unroll
    for (int i = 0; i < Tr::kBlockKeys / kRowsPerPass; ++i) {
      const int r = r0 + i * kRowsPerPass;
      cp_async_16(sK + r * Tr::KVTile::kStride + col, k + i * k_step, true);
      cp_async_16(sV + r * Tr::KVTile::kStride + col, v + i * v_step, true);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < Tr::kBlockKeys / kRowsPerPass; ++i) {
    const int r = r0 + i * kRowsPerPass, j = j0 + r;
    T* dk = sK + r * Tr::KVTile::kStride + col;
    T* dv = sV + r * Tr::KVTile::kStride + col;
    if (j < k_end) {
      const CacheSlot at = cache_slot(dp, b, seq, seq.leftpad + j);
      cp_async_16(dk, at_slot<const T>(k_head, p.k_strides, at) + col, true);
      cp_async_16(dv, at_slot<const T>(v_head, p.v_strides, at) + col, true);
    } else {
      cp_async_16(dk, k_head, false);
      cp_async_16(dv, v_head, false);
    }
  }
}

// The logit pipeline and the online softmax on a warp's S (16 rows x 16 keys, C fragments: this lane's rows g and
// g + 8, keys 2t, 2t + 1 of each n8 tile), in place: S becomes P, alpha the rows' rescale. Key j0 + k of row r counts
// iff it is in [lo, hi) of the row and before k_end; the others are −inf and weigh 0. l is this lane's part of the row
// sum (the quad's parts are added at the end); m is the row's (quad-reduced, NaN kept).
// kPlain: every real row sees every key of the slice and the logits are scale · qk alone (no softcap, no ALiBi), so no
// key is tested (the padding rows then weigh keys too: their rows are never written).
template <bool kPlain>
__device__ __forceinline__ void slice_softmax(float (&s)[1][2][4], const AttentionParams& p, const Row (&rows)[2],
                                              int j0, int k_end, int lane, float (&m)[2], float (&l)[2],
                                              float (&alpha)[2]) {
  const float scale_log2 = p.scale * kLog2e;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = kNegInf;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[0][n][2 * r + e];
        if constexpr (kPlain) {
          x *= scale_log2;
        } else {
          const int j = j0 + n * 8 + (lane % 4) * 2 + e;
          const bool visible = j < k_end && j >= rows[r].lo && j < rows[r].hi;
          x = visible ? logit(p, x, rows[r], j) : kNegInf;
        }
        mx = max_nan(mx, x);
      }
    mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = max_nan(m[r], mx);
    // All −inf so far: weights 0, α 1 (the CPU's rule); else α = 2^(m − m'), 0 on a first key.
    alpha[r] = m_new == kNegInf ? 1.0f : exp2_approx(m[r] - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[0][n][2 * r + e];
        x = m_new == kNegInf ? 0.0f : exp2_approx(x - m_new);
        sum += x;
      }
    l[r] = fmaf(alpha[r], l[r], sum);
    m[r] = m_new;
  }
}

// Whether a key of the warp's slice (keys j0 .. j0 + 15 in rows 0 .. 15 of sV) that some row hides (outside
// [all_lo, all_hi), before k_end) has a NaN or inf in its value row. Two lanes a key, half a row each.
template <int D, class T, int kLd>
__device__ __forceinline__ bool hidden_value_nonfinite(const T* sV, int j0, int k_end, int all_lo, int all_hi,
                                                       int lane) {
  const int k = lane / 2, j = j0 + k;
  bool bad = false;
  if (j < k_end && (j < all_lo || j >= all_hi)) {
    const uint4* v = reinterpret_cast<const uint4*>(sV + k * kLd + (lane % 2) * (D / 2));
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
      const uint4 x = v[c];
      bad |= nonfinite2<T>(x.x) || nonfinite2<T>(x.y) || nonfinite2<T>(x.z) || nonfinite2<T>(x.w);
    }
  }
  return __any_sync(0xffffffffu, bad);
}

// O += P V over the slice's keys lane by lane, each row only over the keys it sees: a hidden key's value is never
// multiplied into the row. P of key k for row g sits on lane 4g + (k % 8) / 2 (S's C fragment layout).
template <int D, class T, int kLd>
__device__ __forceinline__ void slice_pv_visible_only(float (&o)[1][D / 8][4], const float (&s)[1][2][4],
                                                      const T* sV, const Row (&rows)[2], int j0, int k_end, int lane) {
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int owner = (lane & ~3) | ((k % 8) / 2), j = j0 + k;
    float pk[2];
    pk[0] = __shfl_sync(0xffffffffu, s[0][k / 8][k % 2], owner);
    pk[1] = __shfl_sync(0xffffffffu, s[0][k / 8][2 + k % 2], owner);
    const T* v = sV + k * kLd + (lane % 4) * 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (!(j < k_end && j >= rows[r].lo && j < rows[r].hi)) continue;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const float2 x = unpack2<T>(*reinterpret_cast<const uint32_t*>(v + n * 8));
        o[0][n][2 * r] = fmaf(pk[r], x.x, o[0][n][2 * r]);
        o[0][n][2 * r + 1] = fmaf(pk[r], x.y, o[0][n][2 * r + 1]);
      }
    }
  }
}

// Grid: x = (batch · Hkv) · row tiles, y = the splits. Writes out and lse (one split), or the split's partials.
// kPaged: the cache is paged (a block table), else its rows of a sequence lie a fixed stride apart.
template <int D, class T, int kRing, bool kPaged>
__global__ void __launch_bounds__(kDecodeThreads) split_kernel(const DecodeParams dp) {
  using Tr = Traits<D, T, kRing>;
  constexpr int kRows = Tr::kRows, kStages = Tr::kStages, kBlockKeys = Tr::kBlockKeys;
  constexpr int kLdQ = Tr::QTile::kStride, kLd = Tr::KVTile::kStride;
  extern __shared__ __align__(16) char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + Tr::QTile::kElems;  // [kStages] tiles
  T* sV = sK + kStages * Tr::KVTile::kElems;

  const AttentionParams& p = dp.p;
  const int bk = blockIdx.x / dp.row_tiles, tile = blockIdx.x % dp.row_tiles;
  const int b = static_cast<int>(bk / p.num_kv_heads), kvh = static_cast<int>(bk % p.num_kv_heads);
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int rows_total = static_cast<int>(group * p.q_len);
  const int rho0 = tile * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Sequence seq = sequence_of(dp, b);

  // This lane's rows g and g + 8 of the tile. Over the tile's real rows: [k_lo, k_hi) the union of the keys they see
  // (the block reads it), [all_lo, all_hi) the keys every one of them sees (a key outside it is hidden from some row).
  Row rows[2];
  int k_lo = seq.len, k_hi = 0, all_lo = 0, all_hi = seq.len;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int rho = rho0 + lane / 4 + 8 * r;
    rows[r] = row_of(dp, b, kvh, rho, seq.len);
    if (rows[r].hi > rows[r].lo) {
      k_lo = min(k_lo, rows[r].lo);
      k_hi = max(k_hi, rows[r].hi);
    }
    if (rho < rows_total) {
      all_lo = max(all_lo, rows[r].lo);
      all_hi = min(all_hi, rows[r].hi);
    }
  }
#pragma unroll
  for (int offset = 4; offset < 32; offset *= 2) {
    k_lo = min(k_lo, __shfl_xor_sync(0xffffffffu, k_lo, offset));
    k_hi = max(k_hi, __shfl_xor_sync(0xffffffffu, k_hi, offset));
    all_lo = max(all_lo, __shfl_xor_sync(0xffffffffu, all_lo, offset));
    all_hi = min(all_hi, __shfl_xor_sync(0xffffffffu, all_hi, offset));
  }
  const KeyRange keys = split_keys(k_lo, k_hi, blockIdx.y, gridDim.y, kBlockKeys);
  const bool plain_logits = !(p.softcap > 0.0f) && !p.alibi_slopes;
  const int n_tiles = (keys.end - keys.begin + kBlockKeys - 1) / kBlockKeys;

  // Q's 16 rows (zeros for the padding rows) join the first tile's copy.
  {
    constexpr int kChunks = D / 8;
    for (int idx = threadIdx.x; idx < kRows * kChunks; idx += Tr::kThreads) {
      const int r = idx / kChunks, col = (idx % kChunks) * 8, rho = rho0 + r;
      const bool valid = rho < rows_total;
      const T* q = static_cast<const T*>(p.q);
      const T* src = valid ? q + b * p.q_strides[0] + (kvh * group + rho % group) * p.q_strides[1] +
                                 (rho / group) * p.q_strides[2] + col
                           : q;
      cp_async_16(sQ + r * kLdQ + col, src, valid);
    }
  }
  const T* k_head = static_cast<const T*>(p.k) + kvh * p.k_strides[1];
  const T* v_head = static_cast<const T*>(p.v) + kvh * p.v_strides[1];
  // The ring: tiles 0 .. kStages − 2 in flight before any is used (one commit group a tile, empty past the last).
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < n_tiles)
      copy_kv_tile_async<Tr, D, kPaged>(sK + t * Tr::KVTile::kElems, sV + t * Tr::KVTile::kElems, dp, k_head, v_head,
                                        b, seq, keys.begin + t * kBlockKeys, keys.end);
    cp_async_commit();
  }

  uint32_t q_frag[1][D / 16][4];
  float o[1][D / 8][4];
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
  zero_frags(o);
  for (int i = 0; i < n_tiles; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile i is in stage i % kStages, and every warp is done with stage (i − 1) % kStages
    if (i == 0) load_a_frags<T, 1, D, kLdQ>(q_frag, sQ, lane);
    {  // tile i + kStages − 1 into the stage tile i − 1 left
      const int t = i + kStages - 1;
      if (t < n_tiles)
        copy_kv_tile_async<Tr, D, kPaged>(sK + (t % kStages) * Tr::KVTile::kElems,
                                          sV + (t % kStages) * Tr::KVTile::kElems, dp, k_head, v_head, b, seq,
                                          keys.begin + t * kBlockKeys, keys.end);
      cp_async_commit();
    }
    // The warp's slice: keys j0 .. j0 + 15, rows warp · 16 .. of the stage.
    const int j0 = keys.begin + i * kBlockKeys + warp * Tr::kWarpKeys;
    const T* sKw = sK + (i % kStages) * Tr::KVTile::kElems + warp * Tr::kWarpKeys * kLd;
    const T* sVw = sV + (i % kStages) * Tr::KVTile::kElems + warp * Tr::kWarpKeys * kLd;

    // S = Q K_sliceᵀ (the slice's rows are Kᵀ's columns: B stored n-major)
    float s[1][2][4];
    zero_frags(s);
    warp_gemm_rs<T, 1, 2, D, kLd, false>(s, q_frag, sKw, lane);
    float alpha[2];
    if (plain_logits && j0 >= all_lo && j0 + Tr::kWarpKeys <= min(all_hi, keys.end))
      slice_softmax<true>(s, p, rows, j0, keys.end, lane, m, l, alpha);
    else
      slice_softmax<false>(s, p, rows, j0, keys.end, lane, m, l, alpha);
    // O ·= α, skipped where every α of the warp is 1 (most tiles, once the first few have set the maxima).
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[0][n][0] *= alpha[0];
        o[0][n][1] *= alpha[0];
        o[0][n][2] *= alpha[1];
        o[0][n][3] *= alpha[1];
      }
    }
    // O += P V_slice on tensor cores, unless a key some row hides has a non-finite value (rare: checked only where
    // some row hides a key of the slice).
    const int last = min(j0 + Tr::kWarpKeys, keys.end);
    const bool some_hidden = j0 < last && (j0 < all_lo || last > all_hi);
    if (some_hidden && hidden_value_nonfinite<D, T, kLd>(sVw, j0, keys.end, all_lo, all_hi, lane)) {
      slice_pv_visible_only<D, T, kLd>(o, s, sVw, rows, j0, keys.end, lane);
    } else {
      uint32_t p_frag[1][1][4];
      c_to_a_frags<T, 1, 2>(p_frag, s);
      warp_gemm_rs<T, 1, D / 8, 16, kLd, true>(o, p_frag, sVw, lane);
    }
  }

  // The warps' partials, merged through shared memory over the drained ring.
  cp_async_wait<0>();
  launch_dependents();
  __syncthreads();
  float* sm_o = reinterpret_cast<float*>(smem);  // [kWarps][kRows][kOStride]
  float* sm_m = sm_o + Tr::kWarps * kRows * Tr::kOStride;
  float* sm_l = sm_m + Tr::kWarps * kRows;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = lane / 4 + 8 * r;
    const float row_l = quad_sum(l[r]);
    float* dst = sm_o + (warp * kRows + row) * Tr::kOStride + (lane % 4) * 2;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[0][n][2 * r], o[0][n][2 * r + 1]);
    if (lane % 4 == 0) {
      sm_m[warp * kRows + row] = m[r];
      sm_l[warp * kRows + row] = row_l;
    }
  }
  __syncthreads();
  merge_parts_and_write<D, T, kRows, Tr::kWarps, Tr::kOStride>(dp, sm_o, sm_m, sm_l, b, kvh, bk, rho0);
}

// ---- the float32 path: one split of one (batch, kv head, row tile), scalar ---------------------------------
// float32 has no mma: R rows a block (1, 2, 4 or 8), kLanes lanes per key row with 16-byte loads (d = 128: 32 lanes,
// one key per warp-load), kGroups key groups side by side, kUnroll keys each in flight before any is used, the next
// step's keys prefetched into L2; S by a butterfly over a key's lanes, the online softmax row by row. Grid as the
// tensor-core kernel's.
template <int D, class T, int R>
struct ScalarTraits {
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
template <int D, class T, int R>
__global__ void __launch_bounds__(kDecodeThreads) scalar_split_kernel(const DecodeParams dp) {
  using Tr = ScalarTraits<D, T, R>;
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
  // This split's share of them.
  const KeyRange keys = split_keys(k_lo, k_hi, split, gridDim.y, 1);
  const int k_begin = keys.begin, k_end = keys.end;

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
  launch_dependents();
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
  merge_parts_and_write<D, T, R, kGroups, D>(dp, &sm_o[0][0][0], &sm_m[0][0], &sm_l[0][0], b, kvh, bk, rho0);
}

// ---- the merge of the splits ------------------------------------------------------------------------
// A block per output row (batch, kv head, ρ). Every warp loads m_s, l_s of every split (a split a lane) and, in the
// same round trip, the O_s rows of its first kFirstSplits splits (s = warp + kWarps·i); M, l and the weights
// 2^(m_s − M) then come from shuffles, and each warp sums its splits' weighted O rows (every kWarps-th split; past
// kWarps·kFirstSplits splits, 32 more a round trip); warp 0 adds the warps' sums in order and writes out = O / l and
// lse. One dependent round trip through L2 for up to 32 splits: loading M, then l, then O in turn made B 1 steps 3-4 %
// longer (H200, 8192 and 32768 keys).
template <int D, class T>
__global__ void __launch_bounds__(kDecodeThreads) combine_kernel(const DecodeParams dp) {
  constexpr int kCols = D / 32, kWarps = kDecodeThreads / 32;  // columns per lane: c = lane + 32·k, coalesced
  constexpr int kFirstSplits = 32 / kWarps, kLaneSplits = kDecodeMaxSplits / 32;
  static_assert(kFirstSplits * kWarps == 32 && kLaneSplits * 32 == kDecodeMaxSplits, "the first 32 splits' weights on "
                "lanes 0 .. 31 of w_s[0]");
  __shared__ float sm_o[kWarps - 1][D];
  const AttentionParams& p = dp.p;
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int rows_total = static_cast<int>(group * p.q_len);
  const int64_t id = blockIdx.x;
  if (id >= p.batch * p.num_kv_heads * rows_total) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, splits = dp.splits;
  wait_for_prerequisite_grid();  // the split blocks' partials are written
  const int rho = static_cast<int>(id % rows_total);
  const int64_t bk = id / rows_total;
  const int b = static_cast<int>(bk / p.num_kv_heads), kvh = static_cast<int>(bk % p.num_kv_heads);
  const int64_t split_stride = static_cast<int64_t>(rows_total);
  const float* ml = dp.part_ml + 2 * (bk * splits * rows_total + rho);
  const float* po = dp.part_o + (bk * splits * rows_total + rho) * D;
  const auto o_of = [&](int s, int k) { return po[s * split_stride * D + lane + 32 * k]; };
  float first[kFirstSplits][kCols];
#pragma unroll
  for (int i = 0; i < kFirstSplits; ++i) {
    const int s = warp + kWarps * i;
#pragma unroll
    for (int k = 0; k < kCols; ++k) first[i][k] = s < splits ? o_of(s, k) : 0.0f;
  }
  float m_s[kLaneSplits], l_s[kLaneSplits];  // split lane + 32·j
#pragma unroll
  for (int j = 0; j < kLaneSplits; ++j) {
    const int s = lane + 32 * j;
    m_s[j] = s < splits ? ml[2 * s * split_stride] : kNegInf;
    l_s[j] = s < splits ? ml[2 * s * split_stride + 1] : 0.0f;
  }
  float M = kNegInf;
#pragma unroll
  for (int j = 0; j < kLaneSplits; ++j) M = max_nan(M, m_s[j]);
  for (int offset = 16; offset > 0; offset /= 2) M = max_nan(M, __shfl_xor_sync(0xffffffffu, M, offset));
  float w_s[kLaneSplits], L = 0.0f;
#pragma unroll
  for (int j = 0; j < kLaneSplits; ++j) {
    w_s[j] = M == kNegInf ? 0.0f : exp2f(m_s[j] - M);  // even when 0: a NaN in O_s must show
    if (lane + 32 * j < splits) L = fmaf(w_s[j], l_s[j], L);
  }
  for (int offset = 16; offset > 0; offset /= 2) L += __shfl_xor_sync(0xffffffffu, L, offset);
  float O[kCols];
#pragma unroll
  for (int k = 0; k < kCols; ++k) O[k] = 0.0f;
#pragma unroll
  for (int i = 0; i < kFirstSplits; ++i) {
    const int s = warp + kWarps * i;  // (< 32: its weight on lane s of w_s[0])
    if (s < splits) {
      const float w = __shfl_sync(0xffffffffu, w_s[0], s);
#pragma unroll
      for (int k = 0; k < kCols; ++k) O[k] = fmaf(w, first[i][k], O[k]);
    }
  }
#pragma unroll
  for (int j = 1; j < kLaneSplits; ++j) {
    if (32 * j >= splits) break;
#pragma unroll
    for (int i = 0; i < kFirstSplits; ++i) {
      const int s = 32 * j + warp + kWarps * i;
      if (s < splits) {
        const float w = __shfl_sync(0xffffffffu, w_s[j], s % 32);
#pragma unroll
        for (int k = 0; k < kCols; ++k) O[k] = fmaf(w, o_of(s, k), O[k]);
      }
    }
  }
  if (warp > 0) {
#pragma unroll
    for (int k = 0; k < kCols; ++k) sm_o[warp - 1][lane + 32 * k] = O[k];
  }
  __syncthreads();
  if (warp > 0) return;
#pragma unroll
  for (int w = 0; w < kWarps - 1; ++w) {
#pragma unroll
    for (int k = 0; k < kCols; ++k) O[k] += sm_o[w][lane + 32 * k];
  }
  const int h = kvh * group + rho % group, i = rho / group;
  T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + h * p.out_strides[1] + i * p.out_strides[2];
  const float inv_l = L == 0.0f ? 0.0f : 1.0f / L;
#pragma unroll
  for (int k = 0; k < kCols; ++k) out[lane + 32 * k] = from_float<T>(O[k] * inv_l);
  if (lane == 0 && p.lse)
    p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i] = L == 0.0f ? kNegInf : (M + log2f(L)) * kLn2;
}

// The tensor-core split kernel with a ring of Stages tiles. Its dynamic shared memory limit (above the default 48 KiB)
// is raised once per device: cudaFuncSetAttribute is a driver call, and the limit stays set for the process.
template <int D, class T, int Stages, bool kPaged>
cudaError_t launch_tensor_core(const DecodeParams& dp, const dim3& grid, cudaStream_t stream) {
  constexpr int kSmem = Traits<D, T, Stages>::kSmemBytes, kDevices = 64;
  static std::atomic<bool> raised[kDevices];
  const bool cached = dp.device >= 0 && dp.device < kDevices;
  if (!cached || !raised[dp.device].load(std::memory_order_acquire)) {
    const cudaError_t err = cudaFuncSetAttribute(split_kernel<D, T, Stages, kPaged>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
    if (cached) raised[dp.device].store(true, std::memory_order_release);
  }
  split_kernel<D, T, Stages, kPaged><<<grid, kDecodeThreads, kSmem, stream>>>(dp);
  return cudaGetLastError();
}

template <int D, class T, int Stages>
cudaError_t launch_tensor_core(const DecodeParams& dp, const dim3& grid, cudaStream_t stream) {
  return dp.p.block_table ? launch_tensor_core<D, T, Stages, true>(dp, grid, stream)
                          : launch_tensor_core<D, T, Stages, false>(dp, grid, stream);
}

template <int D, class T>
cudaError_t launch_split(const DecodeParams& dp, const dim3& grid, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, float>) {
    switch (dp.rows_per_block) {
      case 1: scalar_split_kernel<D, T, 1><<<grid, kDecodeThreads, 0, stream>>>(dp); break;
      case 2: scalar_split_kernel<D, T, 2><<<grid, kDecodeThreads, 0, stream>>>(dp); break;
      case 4: scalar_split_kernel<D, T, 4><<<grid, kDecodeThreads, 0, stream>>>(dp); break;
      case 8: scalar_split_kernel<D, T, 8><<<grid, kDecodeThreads, 0, stream>>>(dp); break;
      default: return cudaErrorInvalidValue;
    }
  } else {
    if (dp.rows_per_block != kDecodeTileRows) return cudaErrorInvalidValue;
    // kDecodeStages where the ring fits a block's shared memory; 2 (one tile in flight) on GPUs with less (d 128:
    // 106 KiB against 99 KiB on sm_86 / sm_89).
    const bool full_ring = Traits<D, T>::kSmemBytes <= dp.smem_per_block;
    return full_ring ? launch_tensor_core<D, T, kDecodeStages>(dp, grid, stream)
                     : launch_tensor_core<D, T, 2>(dp, grid, stream);
  }
  return cudaGetLastError();
}

// Whether the merge launches dependent on the splits: where its code has its griddepcontrol.wait, compiled for sm_90+
// (its PTX version; so the GPU is one too), not PTX of an older architecture compiled at load time. Once per device.
template <int D, class T>
bool merge_waits(int device) {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices];  // 0 not asked yet, 1 no, 2 yes
  const bool cached = device >= 0 && device < kDevices;
  if (cached && known[device].load(std::memory_order_acquire) != 0) return known[device].load() == 2;
  cudaFuncAttributes attributes{};
  const bool waits = cudaFuncGetAttributes(&attributes, combine_kernel<D, T>) == cudaSuccess &&
                     attributes.ptxVersion >= 90;
  if (cached) known[device].store(waits ? 2 : 1, std::memory_order_release);
  return waits;
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
  const int64_t rows = p.batch * p.num_kv_heads * (p.num_heads / p.num_kv_heads) * p.q_len;
  if (rows == 0) return cudaSuccess;  // no query row: nothing to write
  if (dp.splits > kDecodeMaxSplits) return cudaErrorInvalidValue;  // (the merge reads at most that many partials)
  const dim3 grid(static_cast<unsigned>(p.batch * p.num_kv_heads * dp.row_tiles), dp.splits);
  const cudaError_t err = launch_split<D, T>(dp, grid, stream);
  if (err != cudaSuccess || dp.splits == 1) return err;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(rows));
  config.blockDim = dim3(kDecodeThreads);
  config.stream = stream;
  cudaLaunchAttribute dependent[1];
  dependent[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = dependent;
  config.numAttrs = merge_waits<D, T>(dp.device) ? 1 : 0;
  return cudaLaunchKernelEx(&config, combine_kernel<D, T>, dp);
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
  if (p.dtype != DType::f32) return kDecodeTileRows;
  const int64_t rows = p.num_heads / p.num_kv_heads * p.q_len;
  return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : kDecodeMaxRowsPerBlock;
}

int decode_splits(const AttentionParams& p, int64_t capacity, int rows_per_block, int sms) {
  const int64_t row_tiles = (p.num_heads / p.num_kv_heads * p.q_len + rows_per_block - 1) / rows_per_block;
  const int64_t blocks = p.batch * p.num_kv_heads * row_tiles;
  if (blocks <= 0 || sms <= 0) return 1;
  // At most one split per kDecodeMinSplitKeys keys of the capacity, and kDecodeMaxSplits.
  int64_t most = (capacity + kDecodeMinSplitKeys - 1) / kDecodeMinSplitKeys;
  most = most < 1 ? 1 : most > kDecodeMaxSplits ? kDecodeMaxSplits : most;
  // The blocks of s splits fill waves of kDecodeBlocksPerSm · sms; the last wave's empty slots are idle SMs. Take the
  // fewest splits (fewest partials to merge) whose waves are within kDecodeWaveEfficiency of the best count's.
  const double slots = static_cast<double>(kDecodeBlocksPerSm) * sms;
  auto efficiency = [&](int64_t s) {
    const double waves = static_cast<double>(blocks * s) / slots;
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= most; ++s) best = std::max(best, efficiency(s));
  for (int64_t s = 1; s <= most; ++s)
    if (efficiency(s) >= kDecodeWaveEfficiency * best) return static_cast<int>(s);
  return 1;
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
