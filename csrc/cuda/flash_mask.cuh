// The general kernels' logit pipeline: attn_mask, sliding window, attn_mask's key ranges, softcap, ALiBi and dropout
// on a tile of scores in registers, as attention.h defines them (csrc/kernels/flash.cpp is the reference). For the
// score s = q·k of row i (query head h, batch b) and key j:
//   j outside row i's key span [lo, hi) (keys past kv_len, the causal mask, the window, the key ranges)   -> −inf
//   x = scale · s;   x = cap · tanh(x / cap) (softcap);   x = x − slope · |i + kv_len − q_len − j| (ALiBi);
//   x = x + M_ij (additive attn_mask; −inf there hides the key whatever x is), or −inf where a boolean one is 0;
// the result in base 2 (x · log2 e) for the softmax's exp2. A hidden key's score is set, never added to, so a NaN or
// inf in its k never reaches the row. Dropout (attention.h's generator, the CPU's bits) multiplies P after the
// softmax has summed it: l and lse are those of the undropped P.
// The plain and causal kernels (kGeneral = false) never include any of it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

#include "flash_common.cuh"

namespace cs149gpt {
namespace cuda {

// The keys [lo, hi) row i may see before attn_mask's entries are read: within kv_len, the causal mask, the window and
// attn_mask's key ranges; empty (lo = hi) for a row past q_len or one that sees none. exact: no attn_mask entry of the
// row needs reading (there is none, or its key range says the row shows exactly its keys [first, end), adding
// nothing: flash_cuda.h, mask_key_bounds).
struct KeySpan {
  int lo, hi;
  bool exact;
};
__device__ __forceinline__ KeySpan key_span(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
  if (i >= p.q_len) return {0, 0, true};
  int64_t lo = 0, hi = p.kv_len;
  bool exact = p.mask == nullptr;
  if (p.is_causal) hi = min64(hi, i + p.causal_offset + 1);
  if (p.window_left >= 0) lo = max64(lo, i + p.window_offset - p.window_left);
  if (p.window_right >= 0) hi = min64(hi, i + p.window_offset + p.window_right + 1);
  if (p.key_ranges != nullptr) {
    const int64_t* r =
        p.key_ranges + b * p.key_range_strides[0] + h * p.key_range_strides[1] + i * p.key_range_strides[2];
    lo = max64(lo, r[0]);
    hi = min64(hi, r[1]);
    if (p.mask != nullptr) exact = r[2] != 0;  // (with a mask, ranges are mask_key_bounds' triples)
  }
  lo = min64(lo, p.kv_len);
  return {static_cast<int>(lo), static_cast<int>(max64(lo, hi)), exact};
}

// A group of rows' key spans summed up (the Hopper kernels' key spans): the keys [first, end) some row sees (INT_MAX,
// 0: none), and the keys [full_lo, full_hi) every row sees exactly (empty where a row is not exact or sees none).
struct SpanSummary {
  int first = INT_MAX, end = 0, full_lo = 0, full_hi = INT_MAX;

  __device__ __forceinline__ void add(const KeySpan& span) {
    if (span.hi > span.lo) {
      first = min(first, span.lo);
      end = max(end, span.hi);
    }
    full_lo = max(full_lo, span.lo);
    full_hi = min(full_hi, span.exact ? span.hi : 0);
  }
  __device__ __forceinline__ void merge(const SpanSummary& o) {
    first = min(first, o.first);
    end = max(end, o.end);
    full_lo = max(full_lo, o.full_lo);
    full_hi = min(full_hi, o.full_hi);
  }
  // Over the warp's 32 lanes' summaries (every lane gets it).
  __device__ __forceinline__ SpanSummary over_warp() const {
    return {__reduce_min_sync(0xffffffffu, first), __reduce_max_sync(0xffffffffu, end),
            __reduce_max_sync(0xffffffffu, full_lo), __reduce_min_sync(0xffffffffu, full_hi)};
  }
  __device__ __forceinline__ int4 packed() const { return make_int4(first, end, full_lo, full_hi); }
  __device__ __forceinline__ static SpanSummary from(int4 x) { return {x.x, x.y, x.z, x.w}; }
};

// The keys some row of the block sees: [*first, *end) over every thread's spans (lo, hi: the thread's own, over its
// non-empty spans; lo = INT_MAX, hi = 0 when it has none). Every thread of the block must call it.
__device__ __forceinline__ void block_key_range(int lo, int hi, int* first, int* end) {
  __shared__ int s_first, s_end;
  lo = __reduce_min_sync(0xffffffff, lo);
  hi = __reduce_max_sync(0xffffffff, hi);
  if (threadIdx.x == 0) {
    s_first = INT_MAX;
    s_end = 0;
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) {
    atomicMin(&s_first, lo);
    atomicMax(&s_end, hi);
  }
  __syncthreads();
  *first = s_first;
  *end = s_end;
}

// The base-2 logit x with the attn_mask entry at `at` applied: −inf where a boolean entry is 0 or an additive one is
// −inf, else x + log2(e) · the additive entry.
__device__ __forceinline__ float with_mask_entry_at(const AttentionParams& p, float x, const char* at) {
  if (p.mask_kind == MaskKind::boolean) return *reinterpret_cast<const uint8_t*>(at) == 0 ? -INFINITY : x;
  const float m = p.mask_dtype == DType::f32    ? *reinterpret_cast<const float*>(at)
                  : p.mask_dtype == DType::bf16 ? __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(at))
                                                : __half2float(*reinterpret_cast<const __half*>(at));
  return m == -INFINITY ? -INFINITY : fmaf(m, kLog2e, x);
}

// One (batch, query head)'s logit pipeline: everything after S = Q Kᵀ up to the base-2 logit (the top of this file).
struct Logits {
  const char* mask = nullptr;  // attn_mask's entry (b, h, 0, 0); null without one
  int64_t mask_row = 0, mask_key = 0;  // its strides in bytes
  float slope = 0.f;                   // ALiBi's (0: none)

  __device__ __forceinline__ Logits() {}
  __device__ __forceinline__ Logits(const AttentionParams& p, int64_t b, int64_t h) {
    if (p.mask_kind != MaskKind::none) {
      const int64_t bytes = p.mask_kind == MaskKind::boolean ? 1 : element_bytes_of(p.mask_dtype);
      mask = static_cast<const char*>(p.mask) + (b * p.mask_strides[0] + h * p.mask_strides[1]) * bytes;
      mask_row = p.mask_strides[2] * bytes;
      mask_key = p.mask_strides[3] * bytes;
    }
    if (p.alibi_slopes != nullptr) slope = p.alibi_slopes[b * p.alibi_strides[0] + h * p.alibi_strides[1]];
  }
  __device__ __forceinline__ static int64_t element_bytes_of(DType t) { return t == DType::f32 ? 4 : 2; }

  // The base-2 logit of raw score s at (i, j), a key of i's span; *d_cap (optional): softcap's derivative, 1 − tanh².
  // read_mask: whether i's span leaves attn_mask's entries to read (KeySpan::exact false).
  __device__ __forceinline__ float operator()(const AttentionParams& p, float s, int64_t i, int64_t j, bool read_mask,
                                              float* d_cap = nullptr) const {
    // (in base 2 throughout: every term times log2 e, so that the plain case is one multiply)
    float x;
    if (p.softcap > 0.f) {
      const float t = tanhf(s * p.scale / p.softcap);
      x = p.softcap * kLog2e * t;
      if (d_cap != nullptr) *d_cap = 1.f - t * t;
    } else {
      x = s * (p.scale * kLog2e);
    }
    if (p.alibi_slopes != nullptr) x -= slope * kLog2e * fabsf(static_cast<float>(i + p.kv_len - p.q_len - j));
    return mask != nullptr && read_mask ? with_mask_entry(p, x, i, j) : x;
  }

  __device__ __forceinline__ float with_mask_entry(const AttentionParams& p, float x, int64_t i, int64_t j) const {
    return with_mask_entry_at(p, x, mask + i * mask_row + j * mask_key);
  }
};

// Dropout's keep mask (attention.h): entry (b, h, i, j) has counter ((b·heads + h)·q_len + i)·kv_len + j + offset and
// weighs 1 / (1 − p) where dropout_keep keeps it, else 0.
struct Dropout {
  uint64_t key = 0, threshold = 0, head_base = 0;
  float keep_scale = 1.f;
  __device__ __forceinline__ Dropout() {}
  __device__ __forceinline__ Dropout(const AttentionParams& p, int64_t b, int64_t h) {
    key = dropout_seed_key(p.dropout_seed);
    threshold = dropout_threshold(p.dropout_p);
    head_base = static_cast<uint64_t>(b * p.num_heads + h) * static_cast<uint64_t>(p.q_len) *
                    static_cast<uint64_t>(p.kv_len) + p.dropout_offset;
    keep_scale = 1.f / (1.f - p.dropout_p);
  }
  __device__ __forceinline__ float operator()(const AttentionParams& p, int64_t i, int64_t j) const {
    const uint64_t counter = head_base + static_cast<uint64_t>(i) * static_cast<uint64_t>(p.kv_len) +
                             static_cast<uint64_t>(j);
    return dropout_keep(key, counter, threshold) ? keep_scale : 0.f;
  }
};

// Forward: one m16 row tile's scores (C fragments: the thread's rows i0 and i0 + 8, spans span[0], span[1]) of the
// key tile starting at n0, raw q·k in, base-2 logits out (−inf where hidden).
template <int kNj>
__device__ __forceinline__ void tile_logits(float (&s)[kNj][4], const AttentionParams& p, const Logits& logits,
                                            const KeySpan (&span)[2], int64_t i0, int64_t n0, int lane) {
#pragma unroll
  for (int n = 0; n < kNj; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2;
      const int64_t j = n0 + n * 8 + (lane % 4) * 2 + (e % 2);
      s[n][e] = j >= span[r].lo && j < span[r].hi ? logits(p, s[n][e], i0 + r * 8, j, !span[r].exact) : -INFINITY;
    }
}

// Forward, tile_logits' shortcut: where both of the thread's rows see every key n0 .. n0 + keys − 1 with no attn_mask
// entry to read, and the call has neither softcap nor ALiBi (plain), the base-2 logit is s · scale · log2 e, what
// Logits gives there, bit for bit.
__device__ __forceinline__ bool sees_whole_tile(const KeySpan (&span)[2], int64_t n0, int keys) {
  return span[0].exact && span[1].exact && span[0].lo <= n0 && span[1].lo <= n0 && span[0].hi >= n0 + keys &&
         span[1].hi >= n0 + keys;
}
template <int kNj>
__device__ __forceinline__ void scale_tile_logits(float (&s)[kNj][4], const AttentionParams& p) {
#pragma unroll
  for (int n = 0; n < kNj; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = s[n][e] * (p.scale * kLog2e);
}

// Forward: P ∘ Z on the same fragments (after the softmax summed P).
template <int kNj>
__device__ __forceinline__ void tile_dropout(float (&s)[kNj][4], const AttentionParams& p, const Dropout& z,
                                             int64_t i0, int64_t n0, int lane) {
#pragma unroll
  for (int n = 0; n < kNj; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] *= z(p, i0 + (e / 2) * 8, n0 + n * 8 + (lane % 4) * 2 + (e % 2));
}

// Backward, on a warp's transposed tiles (keys as rows, queries as columns): from raw Sᵀ = K Qᵀ (in pt) and
// dPᵀ = V dOᵀ (in dst), for keys n0 + key0 + .. and queries m0 + q0 + .. (spans (lo, hi, exact), lse·log2 e and D of
// the step's queries, indexed by query within the tile):
//   P = exp2(x − lse·log2 e) (0 where hidden);   dS = P ∘ (Z ∘ dP − D) ∘ (1 − tanh²) (0 where hidden);   Pᵀ ∘ Z -> pt
// (dS without softcap's scale: dK and dQ take it afterwards, as in the plain kernel).
// kWhole: a step every query row of which sees every key of the tile, with no attn_mask entry to read, no softcap,
// ALiBi or dropout (logits, z, dropout and spans unused): x = s · scale · log2 e, what Logits gives there, the same
// values bit for bit without reading the spans or the logit options per entry.
template <int kMi, int kNj, bool kWhole = false>
__device__ __forceinline__ void tile_backward(float (&pt)[kMi][kNj][4], float (&dst)[kMi][kNj][4],
                                              const AttentionParams& p, const Logits& logits, const Dropout& z,
                                              bool dropout, const int4* spans, const float* lse2,
                                              const float* d_row, int64_t m0, int64_t n0, int key0, int q0,
                                              int lane) {
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
    for (int n = 0; n < kNj; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = q0 + n * 8 + (lane % 4) * 2 + (e % 2);
        const int64_t i = m0 + qi, j = n0 + key0 + mi * 16 + lane / 4 + (e / 2) * 8;
        float d_cap = 1.f, x;
        if constexpr (kWhole) {
          x = pt[mi][n][e] * (p.scale * kLog2e);
        } else {
          const int4 span = spans[qi];  // lo, hi, exact
          x = j >= span.x && j < span.y ? logits(p, pt[mi][n][e], i, j, span.z == 0, &d_cap) : -INFINITY;
        }
        const bool hidden = x == -INFINITY;  // (a −inf logit hides its key)
        const float prob = hidden ? 0.f : exp2_approx(x - lse2[qi]);
        const float keep = !kWhole && dropout ? z(p, i, j) : 1.f;
        dst[mi][n][e] = hidden ? 0.f : prob * (dst[mi][n][e] * keep - d_row[qi]) * d_cap;
        pt[mi][n][e] = prob * keep;
      }
}

}  // namespace cuda
}  // namespace cs149gpt
