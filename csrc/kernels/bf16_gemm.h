// The bf16 dot-product micro-kernels of the flash kernel's bf16 path: float32 C (+)= bf16 A · bf16 B.
//
// One signature, two instruction sets (chosen by the translation unit, csrc/isa/):
//   CS149_ISA_AMX          AMX tiles: one tdpbf16ps multiplies a 16×32 bf16 tile by a 32×16 one into a 16×16
//                          float32 tile (16K FLOPs per instruction); a 32×32 block of C lives in 4 tile registers.
//   CS149_ISA_AVX512_BF16  vdpbf16ps: each of 16 float32 lanes gains a[0]·b[0] + a[1]·b[1] for a pair of bf16;
//                          an 8-row × 3-vector block of C lives in 24 zmm registers, as in simd.h's micro_gemm.
// The attention algorithm (flash_bf16.cpp) calls bf16_gemm and never sees a tile or a vector register.
// float16 on the same hardware (flash_bf16.cpp on AMX), and float32 when asked: each operand is split into two or
// three bf16 parts, x = x_0 + x_1 (+ x_2) (split_row, the *_parts packers, exp_shifted_sum_to_bf16_parts), and
// bf16_gemm_parts multiplies (Σ A_i)·(Σ B_j) as the products A_i·B_j it keeps, into float32 accumulators.
//
// Operand layouts (the packing functions below write them):
//   A  M × K bf16, row-major, rows lda elements apart.
//   B  K × N in "VNNI" pairs (B[2i][n], B[2i+1][n]) — two bf16 of consecutive k side by side, so one 32-bit
//      lane holds what one dot-product step needs — stored as 32 × 16 tiles: a tile is 16 pair rows of 16
//      pairs, 1 KB, contiguous (what one AMX tile load reads, and a stream the hardware prefetcher follows);
//      the tiles of a strip of 32 k lie one after another in n, and strips are 32·ldb bf16 apart (ldb: N
//      rounded up to 16, the pairs a VNNI row would hold). vnni_index gives the position of element (k, n).
//   C  M × N float32, rows ldc floats apart.
//   M a multiple of kDotRows, N of kDotCols, K of kDotK (callers pad with zeros).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd.h"

#if defined(CS149_ISA_BF16_DOT)

namespace cs149gpt {
namespace CS149_ISA {

using bf16_bits = uint16_t;  // a bfloat16, as its bits

// kDotRows: the rows of A (and C) one call of the micro-kernel covers; callers move query rows through the
// products in groups of this many.
#if defined(CS149_ISA_AMX)
constexpr int64_t kDotRows = 64;
#else
constexpr int64_t kDotRows = 32;
#endif
constexpr int64_t kDotCols = 16, kDotK = 32;

// The exponent (scale·x − shift)·log2 e of 16 logits, the shift being the row's max of scale·x: one FMA with log2 e
// folded into both constants; or (kExact, for a shift past kExactShiftFrom, simd.h) scale·x rounded first and the
// shift subtracted before log2 e multiplies, so that the row max's own exponent is exactly 0 — the FMA leaves the
// product's rounding residue, up to 2^-25 of the shift, there: 2^860 at logits of 1e10, and inf / inf = NaN.
template <bool kExact>
struct Log2Exponent {
  __m512 a, s, scale, shift;
  Log2Exponent(float shift_, float scale_)
      : a(_mm512_set1_ps(scale_ * 1.44269504088896341f)), s(_mm512_set1_ps(-shift_ * 1.44269504088896341f)),
        scale(_mm512_set1_ps(scale_)), shift(_mm512_set1_ps(shift_)) {}
  __m512 operator()(__m512 x) const {
    if constexpr (!kExact) {
      return _mm512_fmadd_ps(x, a, s);
    } else {
      // An explicit rounding mode keeps GCC from contracting the product and the difference into one FMA (it
      // does so with plain _mm512_mul_ps / _mm512_sub_ps under its default -ffp-contract=fast).
      const __m512 product = _mm512_mul_round_ps(x, scale, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm512_mul_ps(_mm512_sub_ps(product, shift), _mm512_set1_ps(1.44269504088896341f));
    }
  }
};
inline bool exact_exponent_needed(float shift) { return !(std::fabs(shift) < kExactShiftFrom); }

// softcap's exponent (cap · tanh(scale·x / cap) − shift)·log2 e (simd.h's TanhLogit), for the loops below.
struct SoftcapExponent {
  TanhLogit logit;
  SoftcapExponent(float shift, float scale, float cap)
      : logit(scale / cap, cap * 1.44269504088896341f, -shift * 1.44269504088896341f) {}
  __m512 operator()(__m512 x) const { return logit(Vec{x}).v; }
};

// y[c] = bf16(exp(scale·x[c] − shift)) for c < n and 0 for n ≤ c < n_pad; returns the float32 sum of the
// exponentials (round to nearest even; NaN stays NaN). The online softmax's exp pass and the rounding of P for
// P·V in one sweep over the scores. exp(u) = 2^(u·log2 e) (Log2Exponent), and the degree-4 2^ of simd.h is
// accurate enough for a P rounded to bf16.
template <class U>
inline float exp_shifted_sum_to_bf16_with(const U& u, const float* x, int64_t n, bf16_bits* y, int64_t n_pad) {
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {  // two vectors a step: two sums in flight, one 32-lane bf16 store
    const __m512 e0 = exp2_poly<4>(u(_mm512_loadu_ps(x + c)));
    const __m512 e1 = exp2_poly<4>(u(_mm512_loadu_ps(x + c + 16)));
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    _mm512_storeu_si512(y + c, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  for (; c < n; c += 16) {
    const __mmask16 lanes = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(lanes, exp2_poly<4>(u(_mm512_maskz_loadu_ps(lanes, x + c))));
    sum0 = _mm512_add_ps(sum0, e);
    _mm256_mask_storeu_epi16(y + c, lanes, (__m256i)_mm512_cvtneps_pbh(e));
  }
  for (c = n; c < n_pad; ++c) y[c] = 0;
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}
inline float exp_shifted_sum_to_bf16(const float* x, float shift, int64_t n, float scale, bf16_bits* y,
                                     int64_t n_pad) {
  if (exact_exponent_needed(shift)) return exp_shifted_sum_to_bf16_with(Log2Exponent<true>(shift, scale), x, n, y, n_pad);
  return exp_shifted_sum_to_bf16_with(Log2Exponent<false>(shift, scale), x, n, y, n_pad);
}

// Σ a[c]·b[c] over n bf16 pairs, in float32 vectors (the backward's D = rowsum(dO ∘ O)): a bf16 is the high half of
// its float32, so widening is a shift.
inline float dot_bf16(const bf16_bits* a, const bf16_bits* b, int64_t n) {
  const auto widen = [](const bf16_bits* x, __mmask16 lanes) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, x)), 16));
  };
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 lanes = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1u);
    acc = _mm512_fmadd_ps(widen(a + c, lanes), widen(b + c, lanes), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// ---------------------------------------------------------------------------------------------------
// Operands in several bf16 parts (flash_bf16.cpp's float16 and float32 paths). x = x_0 + x_1 + ... with
// x_0 = bf16(x) and each next part the bf16 of what the parts before leave, x − x_0 − ... (exact in float32), all
// rounded to nearest even: each part takes the next 8 (or more) significant bits, so |x − x_0 − ... − x_i| ≤
// 2^(-8(i+1))·|x|. A float16 x (11 significant bits) is exactly x_0 + x_1; a float32 x (24 bits) exactly
// x_0 + x_1 + x_2 — with x's exponent range, fp16 subnormals included, well inside bf16's. A finite float32 past
// bf16's largest finite value (|x| ≥ 0x1.FFp127 rounds to bf16 inf) takes that largest value, ±0x1.FEp127, as x_0:
// x − x_0 is then exact and the parts still sum to x. Only x_0 is kept where it is ±inf or NaN (x − x_0 would be
// NaN: inf − inf), so the sum is still x, and where |x_0| < 2^-100: there the remainders could be float32
// subnormals, and on a Xeon with AMX an instruction whose result underflows costs a microcode assist
// (simd.h, exp); AMX reads bf16 subnormals as 0 anyway. Below 2^-100 a value keeps bf16's 8 bits (an absolute error
// under 2^-108); only weights P get there in practice. The parts of one operand lie one after another, `part` bf16
// apart, each in the operand's layout. Returns the lanes whose x_0 is finite, i.e. whose x is.
// ---------------------------------------------------------------------------------------------------
template <int kParts>
inline __mmask16 split_bf16(__m512 x, __m256i (&part)[kParts]) {
  const auto widen = [](__m256i y) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(y), 16)); };
  const __m512 inf = _mm512_set1_ps(__builtin_inff());
  __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(x), inf, _CMP_LT_OQ);
  const __mmask16 rounded_to_inf = finite & _mm512_cmp_ps_mask(_mm512_abs_ps(widen(h)), inf, _CMP_EQ_OQ);
  if (rounded_to_inf) {  // ±0x1.FEp127: x's sign bit, then bf16's largest finite magnitude
    const __m256i sign = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
    h = _mm256_mask_blend_epi16(rounded_to_inf, h,
                                _mm256_or_si256(_mm256_and_si256(sign, _mm256_set1_epi16(int16_t(0x8000))),
                                                _mm256_set1_epi16(0x7F7F)));
  }
  part[0] = h;
  const __mmask16 has_rest = _mm512_mask_cmp_ps_mask(finite, _mm512_abs_ps(widen(h)), _mm512_set1_ps(0x1p-100f),
                                                     _CMP_GE_OQ);
#pragma GCC unroll 2
  for (int i = 1; i < kParts; ++i) {
    x = _mm512_maskz_sub_ps(has_rest, x, widen(h));
    h = (__m256i)_mm512_cvtneps_pbh(x);
    part[i] = h;
  }
  return finite;
}

inline __mmask16 lanes_below(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

// 16 values as float32 from float32 or from float16 (bits), lanes past `lanes` 0.
inline __m512 load_as_f32(const float* x, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, x); }
inline __m512 load_as_f32(const uint16_t* x, __mmask16 lanes) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, x));
}

// The parts of n values x (float32, or float16 bits) at y + i·part, zero from n to n_pad; returns how many x are
// ±inf or NaN.
template <int kParts, class Src>
inline int64_t split_row(const Src* x, int64_t n, bf16_bits* y, int64_t part, int64_t n_pad) {
  int64_t nonfinite = 0;
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 lanes = lanes_below(n - c);
    __m256i parts[kParts];
    nonfinite += _mm_popcnt_u32(lanes & ~split_bf16<kParts>(load_as_f32(x + c, lanes), parts));
    for (int i = 0; i < kParts; ++i) _mm256_mask_storeu_epi16(y + i * part + c, lanes, parts[i]);
  }
  for (int i = 0; i < kParts; ++i) std::fill(y + i * part + n, y + i * part + n_pad, bf16_bits{0});
  return nonfinite;
}

// exp_shifted_sum_to_bf16 into parts: Σ_i y[i·part + c] ≈ exp(scale·x[c] − shift) to 2^-17 relative with two
// parts, to float32's rounding with three, from simd.h's degree-6 2^ (8.4e-8 relative), since P is no longer
// rounded to 8 bits.
template <int kParts, class U>
inline float exp_shifted_sum_to_bf16_parts_with(const U& u, const float* x, int64_t n, bf16_bits* y, int64_t part,
                                                int64_t n_pad) {
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {  // two vectors a step: two sums in flight
    const __m512 e0 = exp2_poly<6>(u(_mm512_loadu_ps(x + c)));
    const __m512 e1 = exp2_poly<6>(u(_mm512_loadu_ps(x + c + 16)));
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    __m256i p0[kParts], p1[kParts];
    split_bf16<kParts>(e0, p0);
    split_bf16<kParts>(e1, p1);
    for (int i = 0; i < kParts; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * part + c), p0[i]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * part + c + 16), p1[i]);
    }
  }
  for (; c < n; c += 16) {
    const __mmask16 lanes = lanes_below(n - c);
    const __m512 e = _mm512_maskz_mov_ps(lanes, exp2_poly<6>(u(_mm512_maskz_loadu_ps(lanes, x + c))));
    sum0 = _mm512_add_ps(sum0, e);
    __m256i parts[kParts];
    split_bf16<kParts>(e, parts);
    for (int i = 0; i < kParts; ++i) _mm256_mask_storeu_epi16(y + i * part + c, lanes, parts[i]);
  }
  for (int i = 0; i < kParts; ++i) std::fill(y + i * part + n, y + i * part + n_pad, bf16_bits{0});
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}
// float32 (three parts) takes the exact exponent at every shift: a row's max then weighs exactly 1, as in flash.cpp
// (a query that sees one key gets that key's value row, bit for bit). Not with softcap in the exp pass
// (SoftcapExponent, here and in flash.cpp): its tanh is evaluated apart from the max's, which then weighs 1 to
// float32's rounding (the one key's row to an ulp).
template <int kParts>
inline float exp_shifted_sum_to_bf16_parts(const float* x, float shift, int64_t n, float scale, bf16_bits* y,
                                           int64_t part, int64_t n_pad) {
  if (kParts == 3 || exact_exponent_needed(shift))
    return exp_shifted_sum_to_bf16_parts_with<kParts>(Log2Exponent<true>(shift, scale), x, n, y, part, n_pad);
  return exp_shifted_sum_to_bf16_parts_with<kParts>(Log2Exponent<false>(shift, scale), x, n, y, part, n_pad);
}

// One key row t of the bf16 backward's transposed tile (flash_backward_bf16.cpp: keys as rows, n query columns, n
// a multiple of 16), from its scores S and dP = V_j dO_iᵀ in float32:
//   P[c]  = exp(scale·S[c] + M[c] − lse[c])   where query c sees key t (begin[c] ≤ t < end[c], M[c] ≠ −inf), else 0
//   dS[c] = P[c] · (dP[c]·Z[c] − D[c])          where it sees it, else 0 (even where dP is NaN, from a hidden value row)
// P·Z and dS rounded to bf16 (the A operands of dV += (P∘Z)ᵀ dO and dK += dSᵀ Q). Z: dropout's keep mask / (1 − p)
// for this key (flash_common.h, dropout_column), or null (no dropout: 1); M: attn_mask's offsets for this key
// (mask_block), or null (none). The exp is a power of 2 (simd.h's exp2_poly<4>): lse2[c] = lse[c] · log2(e) and the
// exponent one FMA — but in a call with attn_mask (lse_natural), lse2[c] is lse[c] itself and the exponent
// (scale·S [+ M] − lse) · log2(e), summed in natural units first: a row whose every key carries a huge finite offset
// (an additive mask of finfo.min) has lse ≈ −3.4e38, which times log2(e) would overflow to −inf (and P to inf),
// where torch's answer is finite.
template <bool kDropout, bool kNatural, bool kMasked>
inline void softmax_backward_row_to_bf16_with(const float* S, const float* dP, const float* lse2, const float* D,
                                              const int32_t* begin, const int32_t* end, int32_t t, float scale,
                                              int64_t n, bf16_bits* P, bf16_bits* dS, const float* Z, const float* M) {
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512 a = _mm512_set1_ps(scale * kLog2e);
  const __m512i key = _mm512_set1_epi32(t);
  for (int64_t c = 0; c < n; c += 16) {
    __mmask16 seen = _mm512_cmple_epi32_mask(_mm512_loadu_si512(begin + c), key) &
                     _mm512_cmpgt_epi32_mask(_mm512_loadu_si512(end + c), key);
    __m512 u;
    if constexpr (kNatural) {  // (scale·S + M − lse)·log2 e; a key the mask hides is not seen, even where S is NaN
      __m512 logit = _mm512_mul_ps(_mm512_loadu_ps(S + c), _mm512_set1_ps(scale));
      if constexpr (kMasked) {
        const __m512 m = _mm512_loadu_ps(M + c);
        seen &= _mm512_cmp_ps_mask(m, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_UQ);
        logit = _mm512_add_ps(logit, m);
      }
      u = _mm512_mul_ps(_mm512_sub_ps(logit, _mm512_loadu_ps(lse2 + c)), _mm512_set1_ps(kLog2e));
    } else {
      u = _mm512_fmsub_ps(_mm512_loadu_ps(S + c), a, _mm512_loadu_ps(lse2 + c));
    }
    __m512 p = _mm512_maskz_mov_ps(seen, exp2_poly<4>(u)), dp = _mm512_loadu_ps(dP + c);
    if constexpr (kDropout) dp = _mm512_mul_ps(dp, _mm512_loadu_ps(Z + c));
    const __m512 ds = _mm512_maskz_mul_ps(seen, p, _mm512_sub_ps(dp, _mm512_loadu_ps(D + c)));
    if constexpr (kDropout) p = _mm512_mul_ps(p, _mm512_loadu_ps(Z + c));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(P + c), (__m256i)_mm512_cvtneps_pbh(p));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dS + c), (__m256i)_mm512_cvtneps_pbh(ds));
  }
}
inline void softmax_backward_row_to_bf16(const float* S, const float* dP, const float* lse2, const float* D,
                                         const int32_t* begin, const int32_t* end, int32_t t, float scale, int64_t n,
                                         bf16_bits* P, bf16_bits* dS, const float* Z = nullptr,
                                         const float* M = nullptr, bool lse_natural = false) {
  const auto row = [&](auto dropout, auto natural, auto masked) {
    softmax_backward_row_to_bf16_with<decltype(dropout)::value, decltype(natural)::value, decltype(masked)::value>(
        S, dP, lse2, D, begin, end, t, scale, n, P, dS, Z, M);
  };
  using yes = std::true_type;
  using no = std::false_type;
  if (M) return Z ? row(yes{}, yes{}, yes{}) : row(no{}, yes{}, yes{});
  if (lse_natural) return Z ? row(yes{}, yes{}, no{}) : row(no{}, yes{}, no{});
  return Z ? row(yes{}, no{}, no{}) : row(no{}, no{}, no{});
}

// The first element of the packed B tile holding element (k, n), and the position of (k, n) itself.
inline int64_t b_tile_offset(int64_t k, int64_t n, int64_t ldb) { return (k / 32) * 32 * ldb + (n / 16) * 512; }
inline int64_t vnni_index(int64_t k, int64_t n, int64_t ldb) {
  return b_tile_offset(k, n, ldb) + (k % 32) / 2 * 32 + (n % 16) * 2 + k % 2;
}

// The two ways a B operand arrives, packed as above (into a buffer already zeroed past the data):
//   pack_vnni_rows       from B itself, K rows of N values (P V's V_j: k = key, n = head dim). Rows 2i and 2i+1
//                        are interleaved value by value (one permute of two 32-value loads per 32 pairs).
//   pack_vnni_transposed from Bᵀ, N rows of K values (Q Kᵀ's K_j: a key's row holds the k values of column n).
//                        Two consecutive k of one row are already a pair, so each 32-bit word goes to VNNI row
//                        k/2, column n.
// Both read rows `ld` elements apart and count the NaN/inf values they meet (returned: 0 = all finite).
inline int64_t nonfinite_bf16(__m512i x, __mmask32 lanes) {  // exponent all ones: ±inf or NaN
  const __m512i exponent = _mm512_set1_epi16(0x7F80);
  return _mm_popcnt_u32(_mm512_mask_cmpeq_epi16_mask(lanes, _mm512_and_si512(x, exponent), exponent));
}
inline int64_t pack_vnni_rows(int64_t K, int64_t N, const bf16_bits* src, int64_t ld, bf16_bits* B, int64_t ldb) {
  const __m512i low_pairs = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                             6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high_pairs = _mm512_add_epi16(low_pairs, _mm512_set1_epi16(16));
  int64_t nonfinite = 0;
  for (int64_t k = 0; k < K; k += 2) {
    const bf16_bits *even = src + k * ld, *odd = even + ld;
    for (int64_t n = 0; n < N; n += 32) {
      const __mmask32 lanes = N - n >= 32 ? ~__mmask32{0} : (__mmask32)((1u << (N - n)) - 1u);
      const __m512i a = _mm512_maskz_loadu_epi16(lanes, even + n);
      const __m512i b = k + 1 < K ? _mm512_maskz_loadu_epi16(lanes, odd + n) : _mm512_setzero_si512();
      nonfinite += nonfinite_bf16(a, lanes) + nonfinite_bf16(b, lanes);
      const __mmask16 first = N - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1u);
      _mm512_mask_storeu_epi32(B + vnni_index(k, n, ldb), first, _mm512_permutex2var_epi16(a, low_pairs, b));
      if (N - n > 16) {
        const __mmask16 second = N - n >= 32 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n - 16)) - 1u);
        _mm512_mask_storeu_epi32(B + vnni_index(k, n + 16, ldb), second,
                                 _mm512_permutex2var_epi16(a, high_pairs, b));
      }
    }
  }
  return nonfinite;
}
// Transposed, a B tile is a 16 × 16 matrix of 32-bit words — word (pair row w, column n) is the pair of values k =
// 2w, 2w + 1 of key n — and the source rows hold those words in the other order: 16 keys' rows of 32 values are
// one 16 × 16 word transpose (simd.h's transpose16x16, which moves bits as they are) away from a whole tile. An odd
// K's last pair gets its second half from the masked load's zero.
inline void pack_vnni_transposed(int64_t K, int64_t N, const bf16_bits* src, int64_t ld, bf16_bits* B, int64_t ldb) {
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    const int64_t keys = std::min<int64_t>(16, N - n0);
    const __mmask16 key_lanes = lanes_below(keys);
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      const int64_t values = std::min<int64_t>(32, K - k0);
      const __mmask32 value_lanes = values >= 32 ? ~__mmask32{0} : (__mmask32)((1u << values) - 1u);
      __m512 rows[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        rows[i] = i < keys ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(value_lanes, src + (n0 + i) * ld + k0))
                           : _mm512_setzero_ps();
      transpose16x16(rows);
      bf16_bits* tile = B + b_tile_offset(k0, n0, ldb);
#pragma GCC unroll 16
      for (int w = 0; w < 16; ++w) _mm512_mask_storeu_ps(tile + w * 32, key_lanes, rows[w]);
    }
  }
}

// The same two packings from float16 (bits) or float32, into kParts operands of the same layout, `part` bf16 apart
// (split_bf16): pairs of rows become VNNI pairs after the split (rows), or a key row's 32 values become 16 pairs
// scattered down one column of a tile (transposed). Both return how many values are ±inf or NaN.
template <int kParts, class Src>
inline int64_t pack_vnni_rows_parts(int64_t K, int64_t N, const Src* src, int64_t ld, bf16_bits* B, int64_t part,
                                    int64_t ldb) {
  int64_t nonfinite = 0;
  for (int64_t k = 0; k < K; k += 2) {
    const Src *even = src + k * ld, *odd = even + ld;
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 lanes = lanes_below(N - n), odd_lanes = k + 1 < K ? lanes : 0;
      __m256i e[kParts], o[kParts];
      const __mmask16 fe = split_bf16<kParts>(load_as_f32(even + n, lanes), e);
      const __mmask16 fo = split_bf16<kParts>(load_as_f32(odd + n, odd_lanes), o);
      nonfinite += _mm_popcnt_u32(lanes & ~fe) + _mm_popcnt_u32(odd_lanes & ~fo);
      for (int i = 0; i < kParts; ++i)  // 16 pairs (e[c], o[c])
        _mm512_mask_storeu_epi32(B + i * part + vnni_index(k, n, ldb), lanes,
                                 _mm512_or_si512(_mm512_cvtepu16_epi32(e[i]),
                                                 _mm512_slli_epi32(_mm512_cvtepu16_epi32(o[i]), 16)));
    }
  }
  return nonfinite;
}
template <int kParts, class Src>
inline int64_t pack_vnni_transposed_parts(int64_t K, int64_t N, const Src* src, int64_t ld, bf16_bits* B,
                                          int64_t part, int64_t ldb) {
  const __m512i down_a_column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                                    1, 0), _mm512_set1_epi32(16));  // VNNI rows, in words
  int64_t nonfinite = 0;
  for (int64_t n = 0; n < N; ++n) {
    const Src* row = src + n * ld;
    for (int64_t k = 0; k < K; k += 32) {
      const __mmask16 first = lanes_below(K - k), second = K - k > 16 ? lanes_below(K - k - 16) : 0;
      __m256i p0[kParts], p1[kParts];
      const __mmask16 f0 = split_bf16<kParts>(load_as_f32(row + k, first), p0);
      const __mmask16 f1 = split_bf16<kParts>(load_as_f32(row + k + 16, second), p1);
      nonfinite += _mm_popcnt_u32(first & ~f0) + _mm_popcnt_u32(second & ~f1);
      const __mmask16 pairs = lanes_below((std::min<int64_t>(K - k, 32) + 1) / 2);  // odd K: padding's 0 in the last
      const int64_t at = vnni_index(k, n, ldb);
      for (int i = 0; i < kParts; ++i)
        _mm512_mask_i32scatter_epi32(B + i * part + at, pairs, down_a_column,
                                     _mm512_inserti64x4(_mm512_castsi256_si512(p0[i]), p1[i], 1), 4);
    }
  }
  return nonfinite;
}

// Row i of y (rows ldy apart) = bf16(scale · column i of x) for the rows < rows and columns < cols of x (rows ldx
// floats apart): a transposed copy out, 16 × 16 blocks through registers (simd.h's for_each_transposed_block).
inline void store_transposed_scaled_bf16(const float* x, int64_t ldx, int64_t rows, int64_t cols, float scale,
                                         bf16_bits* y, int64_t ldy) {
  for_each_transposed_block(x, ldx, rows, cols, scale,
                            [&](const __m512* block, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
                              const __mmask16 row_lanes = (__mmask16)((1u << nr) - 1u);
#pragma GCC unroll 16
                              for (int i = 0; i < 16; ++i)
                                if (i < nc)
                                  _mm256_mask_storeu_epi16(y + (c0 + i) * ldy + r0, row_lanes, bf16_round(block[i]));
                            });
}

// xt[c · ldt + t] = x[t · ldx + c] for t < rows, c < cols (bf16 bits, a plain transpose; xt is not touched beyond):
// 32 rows × 16 columns at a time, rows paired into 32-bit words (row 2p in the low half) and the 16 × 16 words
// transposed, so that each column's 32 values leave as one 64-byte store. Returns how many values are ±inf or NaN.
inline int64_t transpose_bf16(const bf16_bits* x, int64_t ldx, int64_t rows, int64_t cols, bf16_bits* xt,
                              int64_t ldt) {
  int64_t nonfinite = 0;
  for (int64_t t0 = 0; t0 < rows; t0 += 32) {
    const int64_t nt = std::min<int64_t>(32, rows - t0);
    const __mmask32 out_lanes = nt >= 32 ? ~__mmask32{0} : (__mmask32)((1u << nt) - 1u);
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const int64_t nc = std::min<int64_t>(16, cols - c0);
      const __mmask16 col_lanes = (__mmask16)((1u << nc) - 1u);
      __m512 words[16];
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) {
        const int64_t t = t0 + 2 * p;
        const __m256i even = t < rows ? _mm256_maskz_loadu_epi16(col_lanes, x + t * ldx + c0) : _mm256_setzero_si256();
        const __m256i odd = t + 1 < rows ? _mm256_maskz_loadu_epi16(col_lanes, x + (t + 1) * ldx + c0)
                                         : _mm256_setzero_si256();
        nonfinite += nonfinite_bf16(_mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1),
                                    (__mmask32)col_lanes | ((__mmask32)col_lanes << 16));
        words[p] = _mm512_castsi512_ps(
            _mm512_or_si512(_mm512_cvtepu16_epi32(even), _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16)));
      }
      transpose16x16(words);
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c)
        if (c < nc) _mm512_mask_storeu_epi16(xt + (c0 + c) * ldt + t0, out_lanes, _mm512_castps_si512(words[c]));
    }
  }
  return nonfinite;
}

#if defined(CS149_ISA_AMX)
// ---------------------------------------------------------------------------------------------------
// AMX. Tile registers: 0–3 hold C (a 2 × 2 block of 16×16 float32 tiles), 4–5 A (16 rows × 32 bf16), 6–7 B
// (16 VNNI rows × 16 pairs). One configuration serves every call; each thread loads it once (DotScope).
// ---------------------------------------------------------------------------------------------------
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tile configuration is per thread and shared with everyone else in the process: PyTorch's own AMX
// kernels (oneDNN's brgemm) remember which configuration they loaded last in each thread and do not load it
// again. So a scope that uses the tiles saves what was configured and puts it back when done (or releases the
// tiles if nothing was); otherwise torch's next bf16 matmul would run on our tile shapes and write out of
// bounds.
class DotScope {
 public:
  DotScope() {
    _tile_storeconfig(&saved_);
    TileConfig ours;
    for (int t = 0; t < 8; ++t) {
      ours.colsb[t] = 64;  // 16 float32, 32 bf16 or 16 pairs a row
      ours.rows[t] = 16;
    }
    _tile_loadconfig(&ours);
  }
  ~DotScope() {
    if (saved_.palette_id != 0)
      _tile_loadconfig(&saved_);
    else
      _tile_release();
  }
  DotScope(const DotScope&) = delete;
  DotScope& operator=(const DotScope&) = delete;

 private:
  TileConfig saved_;
};

// The 2 × NB block of C tiles of amx_block and amx_block_parts (tiles 0, 1: rows 0–15, columns 0–15 / 16–31;
// tiles 2, 3: rows 16–31): loaded from C to accumulate into, or zeroed; and stored back.
template <int NB>
inline void c_block_begin(float* C, int64_t ldc, bool accumulate) {
  const int64_t c_stride = ldc * 4;  // bytes
  if (accumulate) {
    _tile_loadd(0, C, c_stride);
    _tile_loadd(2, C + 16 * ldc, c_stride);
    if (NB == 2) {
      _tile_loadd(1, C + 16, c_stride);
      _tile_loadd(3, C + 16 * ldc + 16, c_stride);
    }
  } else {
    _tile_zero(0);
    _tile_zero(2);
    if (NB == 2) {
      _tile_zero(1);
      _tile_zero(3);
    }
  }
}
template <int NB>
inline void c_block_end(float* C, int64_t ldc) {
  const int64_t c_stride = ldc * 4;  // bytes
  _tile_stored(0, C, c_stride);
  _tile_stored(2, C + 16 * ldc, c_stride);
  if (NB == 2) {
    _tile_stored(1, C + 16, c_stride);
    _tile_stored(3, C + 16 * ldc + 16, c_stride);
  }
}

// One k step's 2 × NB products into the C block: the A tiles in 4 and 5 times B's tiles at Bk (column tiles 0
// and, NB = 2, 1), loaded into 6 and 7 first — or, kLoadB false, already there.
template <int NB, bool kLoadB = true>
inline void products_2xNB(const bf16_bits* Bk) {
  constexpr int64_t b_stride = 64;  // bytes (a B tile is contiguous)
  if (kLoadB) _tile_loadd(6, Bk, b_stride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(2, 5, 6);
  if (NB == 2) {
    if (kLoadB) _tile_loadd(7, Bk + 512, b_stride);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// C[0:32, n0:n0+16·NB] (+)= A[0:32, :K] · B[:K, n0:...], NB = 1 or 2 column tiles: a 2 × 2 block of C tiles,
// each A and B tile feeding two products. (A 64 × 16 column block, one B tile feeding four products with A and
// B alternating between tile pairs, ran 5–40 % slower inside the kernel on a 16-core Xeon with AMX.)
template <int NB>
inline void amx_block(int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B, int64_t ldb, float* C,
                      int64_t ldc, bool accumulate) {
  const int64_t a_stride = lda * 2;  // bytes
  c_block_begin<NB>(C, ldc, accumulate);
  for (int64_t k = 0; k < K; k += kDotK) {
    _tile_loadd(4, A + k, a_stride);
    _tile_loadd(5, A + 16 * lda + k, a_stride);
    products_2xNB<NB>(B + b_tile_offset(k, 0, ldb));
  }
  c_block_end<NB>(C, ldc);
}

// C (+)= A · B over M × N × K (see the top of this file for layouts and multiples).
inline void bf16_gemm(int64_t M, int64_t N, int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B,
                      int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t m = 0; m < M; m += 32) {
    int64_t n = 0;
    for (; n + 32 <= N; n += 32)
      amx_block<2>(K, A + m * lda, lda, B + b_tile_offset(0, n, ldb), ldb, C + m * ldc + n, ldc, accumulate);
    if (n < N) amx_block<1>(K, A + m * lda, lda, B + b_tile_offset(0, n, ldb), ldb, C + m * ldc + n, ldc, accumulate);
  }
}

// C (+)= A·B for operands in parts, A = Σ A_i and B = Σ B_j (kParts each, `a_part` and `b_part` bf16 apart), over
// the same 2 × 2 (NB = 2) or 2 × 1 block of C tiles as amx_block: the products A_i·B_j with i + j ≤ kMaxOrder.
// The products left out are below 2^(−8·(kMaxOrder + 1)) of the whole (float16: kMaxOrder 2 keeps all four, 1 drops
// A_1·B_1; float32's three parts: 2 keeps six of nine, dropping what lies below 2^-24).
// A k step's products go A_i by A_i, the B part loaded last first where it is wanted again, then down for even i and
// up for odd i: 5 operand loads per 4 products (float16, S), 4 per 3 (P V), 6 per the 5 small ones of float32.
// Two orders of the sums:
// - k step by k step (float16), every product of a step into C.
// - kSmallFirst (float32): the small products, k step by k step, into zeroed tiles, then A_0·B_0 over all of K; C
//   itself (P V's O) added to at the end, in float32. Added into the large sum step by step, each small product is
//   rounded to the large sum's precision: with float32's six products, twice the error of float32 FMAs (measured
//   under amx_emulated; fine for float16's 11 bits); summed among themselves first they round at
//   their own size, and the large sum takes as many roundings as the float32 FMA kernel's.
template <int NB, int kParts, int kMaxOrder, bool kSkipLargest>
inline void k_step_products(const bf16_bits* A, int64_t a_part, int64_t lda, const bf16_bits* B, int64_t b_part,
                            int64_t ldb, int64_t k) {
  int loaded = -1;  // the B part in tiles 6, 7
#pragma GCC unroll 3
  for (int i = 0; i < kParts && i <= kMaxOrder; ++i) {
    const int first = kSkipLargest && i == 0 ? 1 : 0, last = std::min(kMaxOrder - i, kParts - 1);
    if (first > last) continue;
    _tile_loadd(4, A + i * a_part + k, lda * 2);
    _tile_loadd(5, A + i * a_part + 16 * lda + k, lda * 2);
    int reused = -1;
    if (loaded >= first && loaded <= last) {
      products_2xNB<NB, /*kLoadB=*/false>(nullptr);
      reused = loaded;
    }
#pragma GCC unroll 3
    for (int step = 0; step <= last - first; ++step) {
      const int j = i % 2 == 0 ? last - step : first + step;
      if (j == reused) continue;
      products_2xNB<NB>(B + j * b_part + b_tile_offset(k, 0, ldb));
      loaded = j;
    }
  }
}

template <int NB, int kParts, int kMaxOrder, bool kSmallFirst>
inline void amx_block_parts(int64_t K, const bf16_bits* A, int64_t a_part, int64_t lda, const bf16_bits* B,
                            int64_t b_part, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if constexpr (!kSmallFirst) {
    c_block_begin<NB>(C, ldc, accumulate);
    for (int64_t k = 0; k < K; k += kDotK)
      k_step_products<NB, kParts, kMaxOrder, /*kSkipLargest=*/false>(A, a_part, lda, B, b_part, ldb, k);
    c_block_end<NB>(C, ldc);
    return;
  }
  c_block_begin<NB>(C, ldc, /*accumulate=*/false);
  for (int64_t k = 0; k < K; k += kDotK)
    k_step_products<NB, kParts, kMaxOrder, /*kSkipLargest=*/true>(A, a_part, lda, B, b_part, ldb, k);
  for (int64_t k = 0; k < K; k += kDotK) {  // A_0 · B_0
    _tile_loadd(4, A + k, lda * 2);
    _tile_loadd(5, A + 16 * lda + k, lda * 2);
    products_2xNB<NB>(B + b_tile_offset(k, 0, ldb));
  }
  if (!accumulate) {
    c_block_end<NB>(C, ldc);
    return;
  }
  alignas(64) float block[32 * 32];
  c_block_end<NB>(block, 32);
  for (int r = 0; r < 32; ++r)
    for (int v = 0; v < NB; ++v)
      _mm512_storeu_ps(C + r * ldc + 16 * v,
                       _mm512_add_ps(_mm512_loadu_ps(C + r * ldc + 16 * v), _mm512_load_ps(block + r * 32 + 16 * v)));
}

// C (+)= A·B over M × N × K for operands in parts (amx_block_parts): bf16_gemm on A = Σ A_i, B = Σ B_j, less the
// products past kMaxOrder.
template <int kParts, int kMaxOrder, bool kSmallFirst>
inline void bf16_gemm_parts(int64_t M, int64_t N, int64_t K, const bf16_bits* A, int64_t a_part, int64_t lda,
                            const bf16_bits* B, int64_t b_part, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t m = 0; m < M; m += 32) {
    int64_t n = 0;
    for (; n + 32 <= N; n += 32)
      amx_block_parts<2, kParts, kMaxOrder, kSmallFirst>(K, A + m * lda, a_part, lda, B + b_tile_offset(0, n, ldb),
                                                         b_part, ldb, C + m * ldc + n, ldc, accumulate);
    if (n < N)
      amx_block_parts<1, kParts, kMaxOrder, kSmallFirst>(K, A + m * lda, a_part, lda, B + b_tile_offset(0, n, ldb),
                                                         b_part, ldb, C + m * ldc + n, ldc, accumulate);
  }
}

#else  // CS149_ISA_AVX512_BF16
// ---------------------------------------------------------------------------------------------------
// vdpbf16ps. A pair of A's bf16 (one 32-bit element) is broadcast; 16 pairs of one VNNI row of B (a row of a
// B tile) are one zmm.
// ---------------------------------------------------------------------------------------------------
struct DotScope {};  // vdpbf16ps needs no set-up

template <int R, int NV>
inline void dot_block(int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B, int64_t ldb, float* C,
                      int64_t ldc, bool accumulate) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? _mm512_loadu_ps(C + r * ldc + v * 16) : _mm512_setzero_ps();
  const uint32_t* A_pairs = reinterpret_cast<const uint32_t*>(A);
  const int64_t lda_pairs = lda / 2;
  for (int64_t kk = 0; kk < K / 2; ++kk) {
    __m512i b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(B + vnni_index(2 * kk, 16 * v, ldb));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(A_pairs[r * lda_pairs + kk]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)a, (__m512bh)b[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + v * 16, acc[r][v]);
}

inline void bf16_gemm(int64_t M, int64_t N, int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B,
                      int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  constexpr int R = 8;  // divides kDotRows
  for (int64_t m = 0; m < M; m += R) {
    const bf16_bits* Am = A + m * lda;
    float* Cm = C + m * ldc;
    int64_t n = 0;
    for (; n + 48 <= N; n += 48) dot_block<R, 3>(K, Am, lda, B + b_tile_offset(0, n, ldb), ldb, Cm + n, ldc, accumulate);
    switch ((N - n) / 16) {
      case 1: dot_block<R, 1>(K, Am, lda, B + b_tile_offset(0, n, ldb), ldb, Cm + n, ldc, accumulate); break;
      case 2: dot_block<R, 2>(K, Am, lda, B + b_tile_offset(0, n, ldb), ldb, Cm + n, ldc, accumulate); break;
      default: break;
    }
  }
}

// C (+)= A·B for operands in parts, as passes of bf16_gemm, small products first (the same signature as AMX's).
// The flash kernel takes float16 and float32 this way only on AMX: vdpbf16ps is ~2× the float32 FMA rate, so three
// or more products would lose to converting to float32 (flash.cpp).
template <int kParts, int kMaxOrder, bool kSmallFirst>
inline void bf16_gemm_parts(int64_t M, int64_t N, int64_t K, const bf16_bits* A, int64_t a_part, int64_t lda,
                            const bf16_bits* B, int64_t b_part, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int order = kMaxOrder; order >= 0; --order)
    for (int i = std::max(0, order - (kParts - 1)); i <= std::min(order, kParts - 1); ++i) {
      bf16_gemm(M, N, K, A + i * a_part, lda, B + (order - i) * b_part, ldb, C, ldc, accumulate);
      accumulate = true;
    }
}
#endif

}  // namespace CS149_ISA
}  // namespace cs149gpt

#endif  // CS149_ISA_BF16_DOT
