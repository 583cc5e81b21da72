// The micro-kernels of flash-decoding (flash_decode.cpp): a few query rows against blocks of cached keys, the
// keys read once, in place, in their own dtype (float32, bfloat16 or float16), never converted ahead.
//
//   load_as_float      W floats from a row of float, bf16 or fp16: bf16 is the upper half of a float32 (shift by
//                      16), fp16 goes through vcvtph2ps. Converted in registers, on the way to the FMAs.
//   row_key_dots       S[r, t] = q_r · k_t for every row r and key t of a block: per row and W keys, W vector
//                      accumulators (one per key) over d, then one transposing reduction turns them into the W
//                      dot products as one vector (≈ 3 instructions per dot product instead of ≈ 8 for a
//                      reduction per key). With vdpbf16ps (CS149_ISA_BF16_DOT) bf16 keys are multiplied as bf16
//                      pairs with float32 accumulation: q is bf16 too, so every product is exact.
//   rows_times_values  O[r, :] = α_r · O[r, :] + Σ_t P[r, t] · v_t: an R × NV block of O in registers, each value
//                      vector loaded (and converted) once for R rows.
// Compiled once per ISA, like simd.h, whose Vec it uses.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "simd.h"

namespace cs149gpt {
namespace CS149_ISA {
namespace decode {

constexpr int W = Vec::width;

// The accumulators of a block live in registers only if the helpers that update them are inlined into one loop.
#define CS149_DECODE_INLINE inline __attribute__((always_inline))

// ---------------------------------------------------------------------------------------------------
// W (or the first n < W) elements of a row as float32.
// ---------------------------------------------------------------------------------------------------
template <class T>
CS149_DECODE_INLINE Vec load_as_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::load(p);
  } else {
#if defined(CS149_ISA_AVX512)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
    else
      return {_mm512_cvtph_ps(h)};
#elif defined(CS149_ISA_AVX2)
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
    else
      return {_mm256_cvtph_ps(h)};
#else
    return {static_cast<float>(*p)};
#endif
  }
}

template <class T>
CS149_DECODE_INLINE Vec load_as_float_partial(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::load_partial(p, n);
  } else {
#if defined(CS149_ISA_AVX512)
    const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p);
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
    else
      return {_mm512_cvtph_ps(h)};
#else
    T buf[W] = {};  // the n elements, zeros after: never a read past the row
    std::memcpy(buf, p, n * sizeof(T));
    return load_as_float(buf);
#endif
  }
}

// ---------------------------------------------------------------------------------------------------
// Lane t of the result = the sum of the W lanes of acc[t]: W reductions at once, by halving, pairwise.
// The order of the additions is fixed, so the result does not depend on anything but the inputs.
// ---------------------------------------------------------------------------------------------------
CS149_DECODE_INLINE Vec sum_each(const Vec* acc) {
#if defined(CS149_ISA_AVX512)
  // 1. Pairs (a, b): within each 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3].
  __m512 pair[8];
  for (int i = 0; i < 8; ++i)
    pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i].v, acc[2 * i + 1].v),
                            _mm512_unpackhi_ps(acc[2 * i].v, acc[2 * i + 1].v));
  // 2. Quads: within each 128-bit lane the four keys' sums over that lane.
  __m512 quad[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(pair[2 * i]), y = _mm512_castps_pd(pair[2 * i + 1]);
    quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // 3., 4. Across the 128-bit lanes: lane L of the result ends up holding keys 4L .. 4L + 3.
  const auto fold = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  };
  return {fold(fold(quad[0], quad[1]), fold(quad[2], quad[3]))};
#elif defined(CS149_ISA_AVX2)
  __m256 pair[4];
  for (int i = 0; i < 4; ++i)
    pair[i] = _mm256_add_ps(_mm256_unpacklo_ps(acc[2 * i].v, acc[2 * i + 1].v),
                            _mm256_unpackhi_ps(acc[2 * i].v, acc[2 * i + 1].v));
  __m256 quad[2];
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(pair[2 * i]), y = _mm256_castps_pd(pair[2 * i + 1]);
    quad[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return {_mm256_add_ps(_mm256_permute2f128_ps(quad[0], quad[1], 0x20),
                        _mm256_permute2f128_ps(quad[0], quad[1], 0x31))};
#else
  return acc[0];
#endif
}

// ---------------------------------------------------------------------------------------------------
// S[r·lds + t] = q_r · k_t  for r < rows, t < n;  q_r = q + r·ldq (float32, d_pad ≥ d floats, zero past d),
// k_t = K + t·ldk (d elements of T). Keys are taken W at a time: a row's d columns, up to kDotVecs vectors of them
// at a time, sit in registers while each of the W keys streams past once (one pointer, one FMA per loaded
// vector); the last n % W keys one by one.
// ---------------------------------------------------------------------------------------------------
constexpr int kDotVecs = W >= 16 ? 8 : 4;  // q vectors held: with W accumulators, 24 of 32 zmm (12 of 16 ymm)

template <class T>
inline float dot_as_float(const float* q, const T* k, int64_t d) {
  Vec acc = Vec::zero();
  int64_t c = 0;
  for (; c + W <= d; c += W) acc = fmadd(Vec::load(q + c), load_as_float(k + c), acc);
  if (c < d) acc = fmadd(Vec::load(q + c), load_as_float_partial(k + c, d - c), acc);
  return reduce_add(acc);
}

// acc[t] += q[0 : NV·W] · K[t·ldk + 0 : NV·W]  for t < W; kTail: the last vector has only `last` columns of K.
template <int NV, bool kTail, class T>
CS149_DECODE_INLINE void key_dots_chunk(const float* q, const T* K, int64_t ldk, int64_t last, Vec* acc) {
  Vec qv[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) qv[v] = Vec::load(q + v * W);
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) {
    const T* k = K + t * ldk;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      acc[t] = fmadd(qv[v], kTail && v == NV - 1 ? load_as_float_partial(k + v * W, last) : load_as_float(k + v * W),
                     acc[t]);
  }
}

template <class T>
CS149_DECODE_INLINE void key_dots(const float* q, const T* K, int64_t ldk, int64_t d, Vec* acc) {
  int64_t c = 0;
  for (; c + kDotVecs * W <= d; c += kDotVecs * W) key_dots_chunk<kDotVecs, false>(q + c, K + c, ldk, W, acc);
  const int64_t rest = d - c;
  if (rest == 0) return;
  const int64_t vecs = (rest + W - 1) / W, last = rest - (vecs - 1) * W;
  const bool tail = last < W;
  switch (vecs * 2 + tail) {
#define CS149_KEY_DOTS_CASE(NV)                                                     \
  case 2 * NV: key_dots_chunk<NV, false>(q + c, K + c, ldk, last, acc); break; \
  case 2 * NV + 1: key_dots_chunk<NV, true>(q + c, K + c, ldk, last, acc); break;
    CS149_KEY_DOTS_CASE(1)
    CS149_KEY_DOTS_CASE(2)
    CS149_KEY_DOTS_CASE(3)
    CS149_KEY_DOTS_CASE(4)
#if defined(CS149_ISA_AVX512)
    CS149_KEY_DOTS_CASE(5)
    CS149_KEY_DOTS_CASE(6)
    CS149_KEY_DOTS_CASE(7)
    CS149_KEY_DOTS_CASE(8)
#endif
#undef CS149_KEY_DOTS_CASE
    default: break;
  }
}

template <class T>
inline void row_key_dots(int64_t rows, int64_t n, int64_t d, const float* q, int64_t ldq, const T* K, int64_t ldk,
                         float* S, int64_t lds) {
  int64_t t0 = 0;
  for (; t0 + W <= n; t0 += W)
    for (int64_t r = 0; r < rows; ++r) {
      Vec acc[W];
#pragma GCC unroll 16
      for (int t = 0; t < W; ++t) acc[t] = Vec::zero();
      key_dots(q + r * ldq, K + t0 * ldk, ldk, d, acc);
      sum_each(acc).store(S + r * lds + t0);
    }
  for (; t0 < n; ++t0)
    for (int64_t r = 0; r < rows; ++r) S[r * lds + t0] = dot_as_float(q + r * ldq, K + t0 * ldk, d);
}

#if defined(CS149_ISA_BF16_DOT)
// The same for bf16 keys with vdpbf16ps: q_r as bf16 (qb + r·ldqb, zero past d up to a multiple of 32), each
// step multiplies 16 pairs of q by 16 pairs of k and adds the 32 products into 16 float32 lanes.
CS149_DECODE_INLINE __m512i load_bf16_pairs_partial(const c10::BFloat16* p, int64_t n) {  // n < 32 bf16, zeros after
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1ull), p);
}

template <int NV, bool kTail>
CS149_DECODE_INLINE void key_dots_bf16_chunk(const c10::BFloat16* q, const c10::BFloat16* K, int64_t ldk, int64_t last,
                                             Vec* acc) {
  __m512bh qv[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(q + v * 32);
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) {
    const c10::BFloat16* k = K + t * ldk;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      acc[t].v = _mm512_dpbf16_ps(acc[t].v, qv[v],
                                  (__m512bh)(kTail && v == NV - 1 ? load_bf16_pairs_partial(k + v * 32, last)
                                                                  : _mm512_loadu_si512(k + v * 32)));
  }
}

inline void row_key_dots_bf16(int64_t rows, int64_t n, int64_t d, const c10::BFloat16* qb, int64_t ldqb,
                              const c10::BFloat16* K, int64_t ldk, float* S, int64_t lds) {
  constexpr int kChunk = 4;  // 4 × 32 = 128 columns of q in registers
  int64_t t0 = 0;
  for (; t0 + W <= n; t0 += W)
    for (int64_t r = 0; r < rows; ++r) {
      Vec acc[W];
#pragma GCC unroll 16
      for (int t = 0; t < W; ++t) acc[t] = Vec::zero();
      const c10::BFloat16* q = qb + r * ldqb;
      const c10::BFloat16* Kt = K + t0 * ldk;
      int64_t c = 0;
      for (; c + kChunk * 32 <= d; c += kChunk * 32) key_dots_bf16_chunk<kChunk, false>(q + c, Kt + c, ldk, 32, acc);
      const int64_t rest = d - c;
      if (rest > 0) {
        const int64_t vecs = (rest + 31) / 32, last = rest - (vecs - 1) * 32;
        const bool tail = last < 32;
        switch (vecs * 2 + tail) {
          case 2: key_dots_bf16_chunk<1, false>(q + c, Kt + c, ldk, last, acc); break;
          case 3: key_dots_bf16_chunk<1, true>(q + c, Kt + c, ldk, last, acc); break;
          case 4: key_dots_bf16_chunk<2, false>(q + c, Kt + c, ldk, last, acc); break;
          case 5: key_dots_bf16_chunk<2, true>(q + c, Kt + c, ldk, last, acc); break;
          case 6: key_dots_bf16_chunk<3, false>(q + c, Kt + c, ldk, last, acc); break;
          case 7: key_dots_bf16_chunk<3, true>(q + c, Kt + c, ldk, last, acc); break;
          case 9: key_dots_bf16_chunk<4, true>(q + c, Kt + c, ldk, last, acc); break;
          default: break;
        }
      }
      sum_each(acc).store(S + r * lds + t0);
    }
  for (; t0 < n; ++t0)
    for (int64_t r = 0; r < rows; ++r) {
      __m512 acc = _mm512_setzero_ps();
      const c10::BFloat16* q = qb + r * ldqb;
      const c10::BFloat16* k = K + t0 * ldk;
      int64_t c = 0;
      for (; c + 32 <= d; c += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + c), (__m512bh)_mm512_loadu_si512(k + c));
      if (c < d)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + c),
                               (__m512bh)load_bf16_pairs_partial(k + c, d - c));
      S[r * lds + t0] = _mm512_reduce_add_ps(acc);
    }
}
#endif

// ---------------------------------------------------------------------------------------------------
// O[r·ldo + c] = α_r · O[r·ldo + c] + Σ_{t<n} P[r·ldp + t] · V[t·ldv + c]   for r < R, c < d
// (α_r = 1 when alpha is null). O rows are d_pad ≥ d floats (whole vectors; the padding stays 0). The R × NV
// block of O stays in registers over all n keys; each V vector is loaded and converted once for the R rows.
// ---------------------------------------------------------------------------------------------------
template <int R, int NV, bool kTail, class T>
CS149_DECODE_INLINE void rows_times_values_block(int64_t n, const float* P, int64_t ldp, const T* V, int64_t ldv,
                                                 int64_t last, float* O, int64_t ldo, const float* alpha) {
  // columns [0, NV·W) of O and V from here; kTail: the last vector has only `last` columns of V
  Vec acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const Vec a = Vec::broadcast(alpha ? alpha[r] : 1.0f);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = a * Vec::load(O + r * ldo + v * W);
  }
  for (int64_t t = 0; t < n; ++t) {
    const T* vt = V + t * ldv;
    Vec b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      b[v] = kTail && v == NV - 1 ? load_as_float_partial(vt + v * W, last) : load_as_float(vt + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Vec p = Vec::broadcast(P[r * ldp + t]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(p, b[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v].store(O + r * ldo + v * W);
}

template <int R, class T>
inline void rows_times_values_r(int64_t n, const float* P, int64_t ldp, const T* V, int64_t ldv, int64_t d, float* O,
                                int64_t ldo, const float* alpha) {
  constexpr int NV = 4;
  int64_t c = 0;
  for (; c + NV * W <= d; c += NV * W)
    rows_times_values_block<R, NV, false>(n, P, ldp, V + c, ldv, W, O + c, ldo, alpha);
  const int64_t rest = d - c;  // < NV·W columns left
  if (rest == 0) return;
  const int64_t vecs = (rest + W - 1) / W, last = rest - (vecs - 1) * W;
  const bool tail = last < W;
  switch (vecs * 2 + tail) {
    case 2: rows_times_values_block<R, 1, false>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha); break;
    case 3: rows_times_values_block<R, 1, true>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha); break;
    case 4: rows_times_values_block<R, 2, false>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha); break;
    case 5: rows_times_values_block<R, 2, true>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha); break;
    case 6: rows_times_values_block<R, 3, false>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha); break;
    case 7: rows_times_values_block<R, 3, true>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha); break;
    case 9: rows_times_values_block<R, 4, true>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha); break;
    default: break;
  }
}

// Any number of rows: R = 4 at a time (16 accumulators of O, 4 of V), then the rest.
template <class T>
inline void rows_times_values(int64_t rows, int64_t n, const float* P, int64_t ldp, const T* V, int64_t ldv, int64_t d,
                              float* O, int64_t ldo, const float* alpha) {
  constexpr int R = W >= 16 ? 4 : 2;
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    rows_times_values_r<R>(n, P + r * ldp, ldp, V, ldv, d, O + r * ldo, ldo, alpha ? alpha + r : nullptr);
  for (; r < rows; ++r)
    rows_times_values_r<1>(n, P + r * ldp, ldp, V, ldv, d, O + r * ldo, ldo, alpha ? alpha + r : nullptr);
}

}  // namespace decode
}  // namespace CS149_ISA
}  // namespace cs149gpt
