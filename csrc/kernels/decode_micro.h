// The micro-kernels of flash-decoding (flash_decode.cpp): a few query rows against blocks of cached keys, the
// keys read once, in place, in their own dtype (float32, bfloat16 or float16), never converted ahead.
//
//   load_chunk         the next chunk of a K or V row as float32 vectors, converted in registers. A chunk is what
//                      one load gives: W columns of float32 or float16 (one vector, in column order), or 2W
//                      columns of bfloat16 as two vectors, the even columns then the odd ones: bf16 is the upper
//                      half of a float32, so a shift left by 16 of each 32-bit pair gives the even columns and
//                      masking off the lower half the odd ones — 2 instructions for 2W columns, where widening
//                      them in order takes 4 (two vpmovzxwd on the shuffle port, two shifts). Q and O rows are
//                      kept in this chunk order (to_chunk_order, from_chunk_order: once per task).
//   row_key_dots       S[r, t] = q_r · k_t for every row r and key t of a block: R rows × W/R keys at a time, one
//                      vector accumulator per (row, key) over d, each key chunk loaded and converted once for the
//                      R rows, then one transposing reduction (sum_each) turns the W accumulators into W dot
//                      products as one vector.
//   row_key_dots_bf16  the same with vdpbf16ps (q as bf16 pairs, every product exact), one row at a time: used
//                      where that instruction is as fast as an FMA (kKeysByBf16Dot below).
//   rows_times_values  O[r, :] = α_r · O[r, :] + Σ_t P[r, t] · v_t: an R × NV block of O in registers, each value
//                      chunk loaded (and converted) once for R rows.
// Both kernels can prefetch the next block of keys (or values) into L2 while they work on this one, one row per
// row they read, so the cache's next rows arrive while the arithmetic runs instead of after it.
// Compiled once per ISA, like simd.h, whose Vec it uses.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../heuristics.h"
#include "simd.h"

namespace cs149gpt {
namespace CS149_ISA {
namespace decode {

constexpr int W = Vec::width;

// Keys by vdpbf16ps or by FMAs on converted keys (heuristics.h).
constexpr bool kKeysByBf16Dot = tiles::kDecodeKeysByBf16Dot;

// The accumulators of a block live in registers only if the helpers that update them are inlined into one loop.
#define CS149_DECODE_INLINE inline __attribute__((always_inline))

// ---------------------------------------------------------------------------------------------------
// Chunks: kCols columns of a row as kVecs float32 vectors (see the top of the file).
// ---------------------------------------------------------------------------------------------------
template <class T>
struct Chunk {
  static constexpr bool kEvenOdd = std::is_same_v<T, c10::BFloat16> && W > 1;
  static constexpr int kVecs = kEvenOdd ? 2 : 1;
  static constexpr int kCols = kVecs * W;
  // Where column c (< kCols) of a chunk sits in chunk order.
  static constexpr int position(int c) { return kEvenOdd ? (c % 2) * W + c / 2 : c; }
};
constexpr int kMaxChunkCols = 2 * W;  // row lengths in chunk order are padded to a multiple of this

// W (or the first n < W) elements of a row as float32, in column order (float16, and float32 itself).
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

// The bf16 chunk: 2W columns, even columns to out[0], odd ones to out[1].
#if defined(CS149_ISA_AVX512)
CS149_DECODE_INLINE void split_even_odd(__m512i x, Vec* out) {
  out[0] = {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16))};
  out[1] = {_mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
#elif defined(CS149_ISA_AVX2)
CS149_DECODE_INLINE void split_even_odd(__m256i x, Vec* out) {
  out[0] = {_mm256_castsi256_ps(_mm256_slli_epi32(x, 16))};
  out[1] = {_mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
#endif

template <class T>
CS149_DECODE_INLINE void load_chunk(const T* p, Vec* out) {
  if constexpr (Chunk<T>::kEvenOdd) {
#if defined(CS149_ISA_AVX512)
    split_even_odd(_mm512_loadu_si512(p), out);
#elif defined(CS149_ISA_AVX2)
    split_even_odd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), out);
#endif
  } else {
    out[0] = load_as_float(p);
  }
}

// The first n < kCols columns of a chunk, zeros after (never a read past them).
template <class T>
CS149_DECODE_INLINE void load_chunk_partial(const T* p, int64_t n, Vec* out) {
  if constexpr (Chunk<T>::kEvenOdd) {
#if defined(CS149_ISA_AVX512)
    split_even_odd(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1ull), p), out);
#elif defined(CS149_ISA_AVX2)
    T buf[2 * W] = {};
    std::memcpy(buf, p, n * sizeof(T));
    split_even_odd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf)), out);
#endif
  } else {
    out[0] = load_as_float_partial(p, n);
  }
}

// A row of d elements as float32 in chunk order, zeros up to d_round (a multiple of kMaxChunkCols): what
// load_chunk gives, stored.
template <class T>
inline void to_chunk_order(const T* src, int64_t d, float* dst, int64_t d_round) {
  constexpr int C = Chunk<T>::kCols, V = Chunk<T>::kVecs;
  Vec x[V];
  int64_t c = 0;
  for (; c + C <= d; c += C) {
    load_chunk(src + c, x);
    for (int v = 0; v < V; ++v) x[v].store(dst + c + v * W);
  }
  if (c < d) {
    load_chunk_partial(src + c, d - c, x);
    for (int v = 0; v < V; ++v) x[v].store(dst + c + v * W);
    c += C;
  }
  for (; c < d_round; ++c) dst[c] = 0.0f;
}

// A row of d_round floats in chunk order back to column order, in place.
template <class T>
inline void from_chunk_order(float* row, int64_t d_round) {
  if constexpr (Chunk<T>::kEvenOdd) {
#if defined(CS149_ISA_AVX512)
    // Interleave the even and odd halves: lanes [e0, o0, e1, o1, ...].
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t c0 = 0; c0 < d_round; c0 += 2 * W) {
      const __m512 even = _mm512_loadu_ps(row + c0), odd = _mm512_loadu_ps(row + c0 + W);
      _mm512_storeu_ps(row + c0, _mm512_permutex2var_ps(even, first, odd));
      _mm512_storeu_ps(row + c0 + W, _mm512_permutex2var_ps(even, second, odd));
    }
#else
    constexpr int C = Chunk<T>::kCols;
    float chunk[C];
    for (int64_t c0 = 0; c0 < d_round; c0 += C) {
      std::memcpy(chunk, row + c0, sizeof(chunk));
      for (int c = 0; c < C; ++c) row[c0 + c] = chunk[Chunk<T>::position(c)];
    }
#endif
  }
}

// Rows [first, first + count) of a block (ld elements apart, d each) towards L2: the next block, while this one is
// worked on. A prefetch never faults; these stay within the cache's rows anyway.
template <class T>
CS149_DECODE_INLINE void prefetch_rows(const T* p, int64_t first, int64_t count, int64_t ld, int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t t = first; t < first + count; ++t) {
    const char* row = reinterpret_cast<const char*>(p + t * ld);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
  }
}

// The next block to prefetch while working on this one: its first row, its row stride, how many rows.
template <class T>
struct NextBlock {
  const T* rows = nullptr;  // null: none
  int64_t ld = 0, n = 0;
  // Rows [t, t + count) of it, those that exist.
  CS149_DECODE_INLINE void prefetch(int64_t t, int64_t count, int64_t d) const {
    if (rows && t < n) prefetch_rows(rows, t, std::min(count, n - t), ld, d);
  }
};

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

// dst[i] = lane first + i of x, for i < count.
CS149_DECODE_INLINE void store_lanes(Vec x, int first, int count, float* dst) {
#if defined(CS149_ISA_AVX512)
  // dst − first is inside the same array (the callers' rows are at least W apart): lanes below first are off.
  _mm512_mask_storeu_ps(dst - first, static_cast<__mmask16>(((1u << count) - 1u) << first), x.v);
#else
  alignas(64) float lanes[W];
  x.store(lanes);
  for (int i = 0; i < count; ++i) dst[i] = lanes[first + i];
#endif
}

// ---------------------------------------------------------------------------------------------------
// S[r·lds + t] = q_r · k_t  for r < rows, t < n;  q_r = Q + r·ldq (float32 in chunk order, zero past d),
// k_t = K + t·ldk (d elements of T).
// ---------------------------------------------------------------------------------------------------

// acc[r·KT + k] += q_r · k_k over the d columns, for R rows and KT = W / R keys: per chunk the R rows' q in
// registers (R·kVecs vectors), each key's chunk loaded and converted once, then R·kVecs FMAs.
template <int R, bool kTail, class T>
CS149_DECODE_INLINE void key_dots_step(const float* Q, int64_t ldq, const T* K, int64_t ldk, int64_t last, Vec* acc) {
  constexpr int KT = W / R, V = Chunk<T>::kVecs;
  Vec q[R][V];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) q[r][v] = Vec::load(Q + r * ldq + v * W);
#pragma GCC unroll 16
  for (int k = 0; k < KT; ++k) {
    Vec kv[V];
    if (kTail)
      load_chunk_partial(K + k * ldk, last, kv);
    else
      load_chunk(K + k * ldk, kv);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[r * KT + k] = fmadd(q[r][v], kv[v], acc[r * KT + k]);
  }
}

template <class T>
inline float dot_chunked(const float* q, const T* k, int64_t d) {
  constexpr int C = Chunk<T>::kCols, V = Chunk<T>::kVecs;
  Vec acc = Vec::zero(), kv[V];
  int64_t c = 0;
  for (; c + C <= d; c += C) {
    load_chunk(k + c, kv);
    for (int v = 0; v < V; ++v) acc = fmadd(Vec::load(q + c + v * W), kv[v], acc);
  }
  if (c < d) {
    load_chunk_partial(k + c, d - c, kv);
    for (int v = 0; v < V; ++v) acc = fmadd(Vec::load(q + c + v * W), kv[v], acc);
  }
  return reduce_add(acc);
}

template <int R, class T>
inline void key_dots_rows(int64_t n, int64_t d, const float* Q, int64_t ldq, const T* K, int64_t ldk, float* S,
                          int64_t lds, const NextBlock<T>& next) {
  constexpr int KT = W / R, C = Chunk<T>::kCols;
  int64_t t0 = 0;
  for (; t0 + KT <= n; t0 += KT) {
    next.prefetch(t0, KT, d);
    Vec acc[W];
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) acc[i] = Vec::zero();
    const T* Kt = K + t0 * ldk;
    int64_t c = 0;
    for (; c + C <= d; c += C) key_dots_step<R, false>(Q + c, ldq, Kt + c, ldk, C, acc);
    if (c < d) key_dots_step<R, true>(Q + c, ldq, Kt + c, ldk, d - c, acc);
    const Vec s = sum_each(acc);  // lane r·KT + k: q_r · k_{t0 + k}
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) store_lanes(s, r * KT, KT, S + r * lds + t0);
  }
  for (; t0 < n; ++t0) {
    next.prefetch(t0, 1, d);
    for (int r = 0; r < R; ++r) S[r * lds + t0] = dot_chunked(Q + r * ldq, K + t0 * ldk, d);
  }
}

// Rows 4 at a time (W/4 keys per step), then 2, then 1 (W keys per step); only the first group prefetches.
template <class T>
inline void row_key_dots(int64_t rows, int64_t n, int64_t d, const float* Q, int64_t ldq, const T* K, int64_t ldk,
                         float* S, int64_t lds, const NextBlock<T>& next) {
  const NextBlock<T> none;
  int64_t r = 0;
  if constexpr (W % 4 == 0)
    for (; r + 4 <= rows; r += 4) key_dots_rows<4>(n, d, Q + r * ldq, ldq, K, ldk, S + r * lds, lds, r ? none : next);
  if constexpr (W % 2 == 0)
    for (; r + 2 <= rows; r += 2) key_dots_rows<2>(n, d, Q + r * ldq, ldq, K, ldk, S + r * lds, lds, r ? none : next);
  for (; r < rows; ++r) key_dots_rows<1>(n, d, Q + r * ldq, ldq, K, ldk, S + r * lds, lds, r ? none : next);
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
                              const c10::BFloat16* K, int64_t ldk, float* S, int64_t lds,
                              const NextBlock<c10::BFloat16>& next) {
  constexpr int kChunk = 4;  // 4 × 32 = 128 columns of q in registers
  int64_t t0 = 0;
  for (; t0 + W <= n; t0 += W) {
    next.prefetch(t0, W, d);
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
  }
  for (; t0 < n; ++t0) {
    next.prefetch(t0, 1, d);
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
}
#endif

// ---------------------------------------------------------------------------------------------------
// O[r·ldo + ·] = α_r · O[r·ldo + ·] + Σ_{t<n} P[r·ldp + t] · v_t   for r < R, over the d columns in chunk order
// (α_r = 1 when alpha is null). O rows are whole chunks (the padding stays 0). The R × NV block of O stays in
// registers over all n keys; each V chunk is loaded and converted once for the R rows.
// ---------------------------------------------------------------------------------------------------
template <int R, int NC, bool kTail, class T>
CS149_DECODE_INLINE void rows_times_values_block(int64_t n, const float* P, int64_t ldp, const T* V, int64_t ldv,
                                                 int64_t last, float* O, int64_t ldo, const float* alpha,
                                                 const NextBlock<T>& next, int64_t d) {
  // NC chunks of O and V from here; kTail: the last chunk has only `last` columns of V
  constexpr int CV = Chunk<T>::kVecs, C = Chunk<T>::kCols, NV = NC * CV;
  Vec acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const Vec a = Vec::broadcast(alpha ? alpha[r] : 1.0f);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = a * Vec::load(O + r * ldo + v * W);
  }
  for (int64_t t = 0; t < n; ++t) {
    next.prefetch(t, 1, d);
    const T* vt = V + t * ldv;
    Vec b[NV];
#pragma GCC unroll 4
    for (int ch = 0; ch < NC; ++ch) {
      if (kTail && ch == NC - 1)
        load_chunk_partial(vt + ch * C, last, b + ch * CV);
      else
        load_chunk(vt + ch * C, b + ch * CV);
    }
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
                                int64_t ldo, const float* alpha, const NextBlock<T>& next) {
  constexpr int C = Chunk<T>::kCols, NC = 4 / Chunk<T>::kVecs;  // 4 vectors of O per row: 16 accumulators at R = 4
  const NextBlock<T> none;
  int64_t c = 0;
  for (; c + NC * C <= d; c += NC * C)
    rows_times_values_block<R, NC, false>(n, P, ldp, V + c, ldv, C, O + c, ldo, alpha, c ? none : next, d);
  const int64_t rest = d - c;  // < NC·C columns left
  if (rest == 0) return;
  const int64_t chunks = (rest + C - 1) / C, last = rest - (chunks - 1) * C;
  const bool tail = last < C;
  const NextBlock<T>& pf = c ? none : next;
  switch (chunks * 2 + tail) {
    case 2: rows_times_values_block<R, 1, false>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha, pf, d); break;
    case 3: rows_times_values_block<R, 1, true>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha, pf, d); break;
    case 4: rows_times_values_block<R, 2, false>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha, pf, d); break;
    case 5: rows_times_values_block<R, 2, true>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha, pf, d); break;
    case 6:
      if constexpr (NC > 3) rows_times_values_block<R, 3, false>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha, pf, d);
      break;
    case 7:
      if constexpr (NC > 3) rows_times_values_block<R, 3, true>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha, pf, d);
      break;
    case 9:
      if constexpr (NC > 3) rows_times_values_block<R, 4, true>(n, P, ldp, V + c, ldv, last, O + c, ldo, alpha, pf, d);
      break;
    default: break;
  }
}

// Any number of rows: R = 4 at a time (16 accumulators of O), then the rest; only the first group prefetches.
template <class T>
inline void rows_times_values(int64_t rows, int64_t n, const float* P, int64_t ldp, const T* V, int64_t ldv, int64_t d,
                              float* O, int64_t ldo, const float* alpha, const NextBlock<T>& next = NextBlock<T>()) {
  constexpr int R = W >= 16 ? 4 : 2;
  const NextBlock<T> none;
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    rows_times_values_r<R>(n, P + r * ldp, ldp, V, ldv, d, O + r * ldo, ldo, alpha ? alpha + r : nullptr,
                           r ? none : next);
  for (; r < rows; ++r)
    rows_times_values_r<1>(n, P + r * ldp, ldp, V, ldv, d, O + r * ldo, ldo, alpha ? alpha + r : nullptr,
                           r ? none : next);
}

}  // namespace decode
}  // namespace CS149_ISA
}  // namespace cs149gpt
