// SIMD helpers shared by every kernel: one float vector type per instruction set, a vectorised exp, and
// the row operations (dot, axpy, max, exp-and-sum) the attention kernels are written in.
//
// This header is compiled once per ISA: the translation units in csrc/isa/ define CS149_ISA (the namespace,
// e.g. avx512) and one of CS149_ISA_AVX512 / CS149_ISA_AVX2 / CS149_ISA_SCALAR, switch the compiler's
// target with #pragma GCC target, and then include the kernels. Everything here therefore lives in
// namespace cs149gpt::CS149_ISA, so the three copies never meet at link time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(CS149_ISA_AVX512) || defined(CS149_ISA_AVX2)
#include <immintrin.h>
#endif

namespace cs149gpt {
namespace CS149_ISA {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One turn of a spin-wait on another thread's store (flash_common.h's run_forward_tiles): x86's PAUSE, which spares
// the sibling hyperthread and the memory-order machine clear when the store arrives; elsewhere nothing.
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Asks for the cache line holding `address` (into L2: a block prefetched ahead would leave L1 again while the
// current one streams its K and V tiles through it): a hint, never a fault. As inline asm, because GCC deletes a
// loop of __builtin_prefetch that has no other effect (seen with GCC 12 at -O2 and -O3: flash_common.h's
// prefetch_mask_block compiled to nothing).
inline void prefetch_line(const void* address) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(address)));
#else
  __builtin_prefetch(address, 0, 2);
#endif
}

// ---------------------------------------------------------------------------------------------------
// Vec: `width` floats in one register, with the handful of operations the kernels need.
// load_partial / store_partial touch only the first n < width lanes (the tail of a row).
// ---------------------------------------------------------------------------------------------------
#if defined(CS149_ISA_AVX512)
struct Vec {
  static constexpr int width = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static __mmask16 tail_mask(int64_t n) { return (__mmask16)((1u << n) - 1u); }
  static Vec load_partial(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(tail_mask(n), p)}; }
  static Vec load_partial(const float* p, int64_t n, float fill) {  // `fill` in the lanes from n on
    return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), tail_mask(n), p)};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_partial(float* p, int64_t n) const { _mm512_mask_storeu_ps(p, tail_mask(n), v); }
};
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a*b + c
inline Vec abs(Vec a) { return {_mm512_abs_ps(a.v)}; }
// max propagates NaN (IEEE maximum): vmaxps alone returns its second operand when either is NaN, so a NaN in
// the first would be dropped; the lanes where `a` is NaN are put back.
inline Vec max(Vec a, Vec b) {
  return {_mm512_mask_mov_ps(_mm512_max_ps(a.v, b.v), _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), a.v)};
}
// The larger of x and the running maximum m, a lane where x is NaN keeping m (vmaxps alone: its second operand is
// returned when either is NaN). One instruction where max takes three: for a running maximum that starts at −inf,
// whose NaNs are accounted for elsewhere (online_softmax: a NaN logit turns its row NaN through P all the same).
inline Vec max_skip_nan(Vec x, Vec m) { return {_mm512_max_ps(x.v, m.v)}; }
inline bool all_le(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LE_OQ) == 0xFFFF; }  // NaN: false
// x, but `fill` in the lanes where x < bound (NaN kept)
inline Vec fill_below(Vec x, Vec bound, Vec fill) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, bound.v, _CMP_LT_OQ), x.v, fill.v)};
}
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec a) {  // NaN if any lane is
  if (_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)) return std::numeric_limits<float>::quiet_NaN();
  return _mm512_reduce_max_ps(a.v);
}

#elif defined(CS149_ISA_AVX2)
struct Vec {
  static constexpr int width = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static __m256i tail_mask(int64_t n) {
    // lane i is on when i < n
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Vec load_partial(const float* p, int64_t n) { return {_mm256_maskload_ps(p, tail_mask(n))}; }
  static Vec load_partial(const float* p, int64_t n, float fill) {  // `fill` in the lanes from n on
    const __m256i lanes = tail_mask(n);
    return {_mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, lanes), _mm256_castsi256_ps(lanes))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store_partial(float* p, int64_t n) const { _mm256_maskstore_ps(p, tail_mask(n), v); }
};
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec abs(Vec a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
inline Vec max(Vec a, Vec b) {  // NaN if either is (see the AVX-512 max)
  return {_mm256_blendv_ps(_mm256_max_ps(a.v, b.v), a.v, _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q))};
}
inline Vec max_skip_nan(Vec x, Vec m) { return {_mm256_max_ps(x.v, m.v)}; }  // see the AVX-512 one
inline bool all_le(Vec a, Vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_LE_OQ)) == 0xFF; }
inline Vec fill_below(Vec x, Vec bound, Vec fill) {
  return {_mm256_blendv_ps(x.v, fill.v, _mm256_cmp_ps(x.v, bound.v, _CMP_LT_OQ))};
}
inline float reduce_add(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(Vec a) {  // NaN if any lane is
  if (_mm256_movemask_ps(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q))) return std::numeric_limits<float>::quiet_NaN();
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#else  // CS149_ISA_SCALAR: portable C++, one lane. The compiler may still vectorise the loops around it.
struct Vec {
  static constexpr int width = 1;
  float v;
  static Vec zero() { return {0.0f}; }
  static Vec broadcast(float x) { return {x}; }
  static Vec load(const float* p) { return {*p}; }
  static Vec load_partial(const float* p, int64_t n) { return {n > 0 ? *p : 0.0f}; }
  static Vec load_partial(const float* p, int64_t n, float fill) { return {n > 0 ? *p : fill}; }
  void store(float* p) const { *p = v; }
  void store_partial(float* p, int64_t n) const { if (n > 0) *p = v; }
};
inline Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
inline Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
inline Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
// a*b + c rounded twice: std::fma would be a slow library call on CPUs without the instruction.
inline Vec fmadd(Vec a, Vec b, Vec c) { return {a.v * b.v + c.v}; }
inline Vec abs(Vec a) { return {std::fabs(a.v)}; }
inline Vec max(Vec a, Vec b) { return {a.v > b.v || a.v != a.v ? a.v : b.v}; }  // NaN if either is
inline Vec max_skip_nan(Vec x, Vec m) { return {x.v > m.v ? x.v : m.v}; }  // m where x is NaN (AVX-512's)
inline bool all_le(Vec a, Vec b) { return a.v <= b.v; }  // every lane, NaN: false
inline Vec fill_below(Vec x, Vec bound, Vec fill) { return {x.v < bound.v ? fill.v : x.v}; }
inline float reduce_add(Vec a) { return a.v; }
inline float reduce_max(Vec a) { return a.v; }
#endif

// The larger of a and b, NaN if either is. std::max(a, b) is (a < b ? b : a): it returns a whenever b is NaN,
// so a running max built on it loses a NaN, and the softmax would then silently ignore it.
inline float max_nan(float a, float b) { return a > b || a != a ? a : b; }

// ---------------------------------------------------------------------------------------------------
// exp(x) for a whole vector, accurate to a couple of float32 ulps (Cephes' expf scheme).
//   exp(x) = 2^n · exp(r),  n = round(x·log2(e)),  r = x − n·ln2  with |r| ≤ ln2/2,
// exp(r) from a degree-6 polynomial, 2^n written straight into the exponent bits.
// x > 88.72 overflows to +inf as it should; x < −87 (−inf too) gives exactly 0 — exp(x) < 2^-125.5 is a
// subnormal or nearly one — on every ISA; NaN stays NaN.
// Why never a subnormal, not even on the way to 0: on Intel cores an instruction whose result underflows with
// MXCSR's flush-to-zero off takes a microcode assist of ~100+ cycles, and the masked (causal) lanes of every
// diagonal tile are −inf logits, so each such row would pay it.
// So no lane is ever computed below 2^-125: arguments are clamped above the subnormal range first and the
// lanes below it set to 0 by a mask.
// ---------------------------------------------------------------------------------------------------
namespace exp_constants {
constexpr float kMaxArg = 89.0f;  // above ln(FLT_MAX) = 88.72: y · 2^n overflows to +inf, as exp does
constexpr float kMinArg = -87.0f;  // just above ln(FLT_MIN) = −87.34: y · 2^n stays a normal number
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;  // ln2 split in two so that n·kLn2Hi is exact
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace exp_constants

#if defined(CS149_ISA_AVX512)
inline Vec exp(Vec x) {
  using namespace exp_constants;
  // Clamped to [kMinArg, kMaxArg]; lanes below kMinArg (−inf too) are zeroed at the end, never computed as
  // an underflow. NaN passes through both (the second operand of min/max is returned for NaN) and the
  // unordered compare keeps its lane.
  const __mmask16 normal = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(kMinArg), _CMP_NLT_UQ);
  __m512 xc = _mm512_max_ps(_mm512_set1_ps(kMinArg), _mm512_min_ps(_mm512_set1_ps(kMaxArg), x.v));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(kP0);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP1));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP2));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP3));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP4));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP5));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  // y · 2^n with scalef: no exponent-field overflow at n = 128.
  return {_mm512_maskz_scalef_ps(normal, y, n)};
}
#elif defined(CS149_ISA_AVX2)
inline Vec exp(Vec x) {
  using namespace exp_constants;
  __m256 xc = _mm256_max_ps(_mm256_set1_ps(kMinArg), _mm256_min_ps(_mm256_set1_ps(kMaxArg), x.v));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP1));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP2));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP3));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP4));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP5));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n as two factors 2^(n - n/2) · 2^(n/2), each a normal float, so n = 128 does not overflow early.
  __m256i ni = _mm256_cvtps_epi32(n);
  __m256i half = _mm256_srai_epi32(ni, 1);
  __m256i rest = _mm256_sub_epi32(ni, half);
  __m256 pow_half = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  __m256 pow_rest = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, _mm256_set1_epi32(127)), 23));
  __m256 result = _mm256_mul_ps(_mm256_mul_ps(y, pow_half), pow_rest);
  __m256 underflow = _mm256_cmp_ps(x.v, _mm256_set1_ps(kMinArg), _CMP_LT_OQ);
  return {_mm256_blendv_ps(result, _mm256_setzero_ps(), underflow)};
}
#else
inline Vec exp(Vec x) {
  using namespace exp_constants;
  if (std::isnan(x.v)) return x;
  if (x.v < kMinArg) return {0.0f};
  float xc = x.v < kMaxArg ? x.v : kMaxArg;
  float n = std::nearbyint(xc * kLog2e);
  // The split ln2 keeps r = x − n·ln2 exact without an FMA: n·kLn2Hi has few enough bits to be exact.
  float r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float y = kP0;
  y = y * r + kP1;
  y = y * r + kP2;
  y = y * r + kP3;
  y = y * r + kP4;
  y = y * r + kP5;
  y = y * (r * r) + (r + 1.0f);
  return {std::ldexp(y, (int)n)};
}
#endif

// ---------------------------------------------------------------------------------------------------
// 2^t for a whole vector: 2^t = 2^f · 2^n with n = floor(t) and f = t − n in [0, 1), a polynomial for 2^f
// (coefficients fitted for least maximum relative error), times 2^n by scalef — which floors its exponent
// operand itself, so n is never formed: vreduceps gives f = t − floor(t) in one instruction. For logits already
// in base 2 (flash.cpp folds log2(e) into Q's scale): no multiply by log2(e), no two-step (Cody–Waite) reduction
// as exp needs. Degree 6: relative error 8.4e-8 in float32 arithmetic, as accurate as exp. Degree 4: 2.7e-6, for
// a value that is then rounded to bfloat16 (step 2^-8; bf16_gemm.h). t < −125 (−inf too) gives exactly 0
// without computing a subnormal (see exp): t is clamped to −125 first and those lanes are masked off; t ≥ 128
// gives +inf, NaN stays NaN. (On a 16-core Xeon: 20–25 % faster than rounding t to nearest, subtracting, and
// clamping both sides.)
// ---------------------------------------------------------------------------------------------------
#if defined(CS149_ISA_AVX512)
template <int kDegree>
inline __m512 exp2_poly(__m512 t) {
  static_assert(kDegree == 4 || kDegree == 6, "fitted for degrees 4 and 6");
  constexpr float kDeg6[] = {2.17022534e-04f, 1.24396884e-03f, 9.67884064e-03f, 5.54833412e-02f,
                             2.40229830e-01f, 6.93147004e-01f, 1.00000000e+00f};
  constexpr float kDeg4[] = {1.35341659e-02f, 5.20114675e-02f, 2.41442755e-01f, 6.93003833e-01f,
                             1.00000262e+00f};
  const float* c = kDegree == 6 ? kDeg6 : kDeg4;  // highest power first
  // vmaxps returns the second operand when one is NaN: t goes second, so NaN passes through (and the unordered
  // compare keeps its lane).
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
  t = _mm512_max_ps(_mm512_set1_ps(-125.0f), t);
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // t − floor(t)
  __m512 y = _mm512_set1_ps(c[0]);
#pragma GCC unroll 6
  for (int i = 1; i <= kDegree; ++i) y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(c[i]));
  return _mm512_maskz_scalef_ps(normal, y, t);
}
inline Vec exp2(Vec t) { return {exp2_poly<6>(t.v)}; }
#else
// AVX2 and scalar: through exp (t · ln 2 adds a rounding of relative size |t| · 2^-24 to the argument, which
// only the tiny weights of far-below-max logits notice). These instruction sets are not the fast path.
inline Vec exp2(Vec t) { return exp(t * Vec::broadcast(0.693147180559945309f)); }
#endif

// x[c] = 2^x[c]
inline void exp2_row(float* x, int64_t n) {
  constexpr int W = Vec::width;
  int64_t c = 0;
  for (; c + W <= n; c += W) exp2(Vec::load(x + c)).store(x + c);
  if (c < n) exp2(Vec::load_partial(x + c, n - c)).store_partial(x + c, n - c);
}

// ---------------------------------------------------------------------------------------------------
// tanh(x) for a whole vector, in one pass (softcap's, flash_common.h): with a = min(|x|, 10) and −E = 1 − e^(−2a)
// (expm1, from exp's own reduction and polynomial: E = 2^n · (e^r − 1) + (2^n − 1), n = round(−2a · log2 e),
// r = −2a − n · ln 2, and e^r − 1 = r + r² · P(r) has no cancellation near 0),
//   tanh(a) = −E / (2 + E),   tanh(x) = sign(x) · tanh(a).
// No branch for small |x|: for |x| < 0.17, n = 0 and r = −2a exactly, so E keeps full relative precision down to the
// denormals (tanh(x) = x there). Error ≤ 3e-7 relative everywhere; tanh(±0) = ±0, ±inf (and |x| ≥ 10, where tanh
// rounds to 1 in float32) → ±1, NaN stays NaN (it runs through every step). No subnormal is computed on the way.
// With AVX-512 the quotient is a 14-bit reciprocal and one Newton step (2^-28): with vdivps, softcap cost 1–4 points
// more over the plain kernel on a 2-core EPYC (float32 and bf16, (1,16,2048,64), one thread).
// ---------------------------------------------------------------------------------------------------
constexpr float kTanhSaturates = 10.0f;  // tanh(10) = 1 − 4e-9: 1.0f
#if defined(CS149_ISA_AVX512)
inline Vec tanh(Vec x) {
  using namespace exp_constants;
  // min returns its second operand when either is NaN: |x| second, so a NaN lane stays NaN throughout.
  const __m512 a = _mm512_min_ps(_mm512_set1_ps(kTanhSaturates), _mm512_abs_ps(x.v));
  const __m512 z = _mm512_mul_ps(a, _mm512_set1_ps(-2.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f * kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), z);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(kP0);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP1));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP2));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP3));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP4));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP5));
  const __m512 em1_r = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);  // e^r − 1
  const __m512 pow2n = _mm512_scalef_ps(_mm512_set1_ps(1.0f), n);   // 2^n, n in [−29, 0]
  // −E = (1 − 2^n) − 2^n · (e^r − 1) ≥ +0 (+0 at a = 0), so the quotient's sign bit is clear and x's is put in.
  const __m512 minus_E = _mm512_fnmadd_ps(pow2n, em1_r, _mm512_sub_ps(_mm512_set1_ps(1.0f), pow2n));
  const __m512 den = _mm512_sub_ps(_mm512_set1_ps(2.0f), minus_E);  // 2 + E, in [1, 2]
  const __m512 inv = _mm512_rcp14_ps(den);
  const __m512 t0 = _mm512_mul_ps(minus_E, inv);
  const __m512 t = _mm512_fmadd_ps(t0, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(1.0f)), t0);  // t0 · (2 − den·inv)
  // t | (x & sign bit)
  return {_mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(t), _mm512_castps_si512(x.v),
                                                        _mm512_set1_epi32(INT32_MIN), 0xF8))};
}
#elif defined(CS149_ISA_AVX2)
inline Vec tanh(Vec x) {
  using namespace exp_constants;
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_min_ps(_mm256_set1_ps(kTanhSaturates), _mm256_andnot_ps(sign_bit, x.v));  // NaN kept
  const __m256 z = _mm256_mul_ps(a, _mm256_set1_ps(-2.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f * kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), z);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP1));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP2));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP3));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP4));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP5));
  const __m256 em1_r = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
  // 2^n, n in [−29, 0]: straight into the exponent bits (a NaN lane's n converts to INT_MIN: its 2^n is some
  // number, and its NaN r carries on).
  const __m256 pow2n =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  const __m256 minus_E = _mm256_fnmadd_ps(pow2n, em1_r, _mm256_sub_ps(_mm256_set1_ps(1.0f), pow2n));
  const __m256 t = _mm256_div_ps(minus_E, _mm256_sub_ps(_mm256_set1_ps(2.0f), minus_E));
  return {_mm256_or_ps(t, _mm256_and_ps(x.v, sign_bit))};
}
#else
inline Vec tanh(Vec x) {
  using namespace exp_constants;
  if (x.v != x.v) return x;
  const float a = std::fabs(x.v) < kTanhSaturates ? std::fabs(x.v) : kTanhSaturates, z = -2.0f * a;
  const float n = std::nearbyint(z * kLog2e);
  float r = z - n * kLn2Hi;  // exact without an FMA (see exp)
  r = r - n * kLn2Lo;
  float y = kP0;
  y = y * r + kP1;
  y = y * r + kP2;
  y = y * r + kP3;
  y = y * r + kP4;
  y = y * r + kP5;
  const float em1_r = y * (r * r) + r;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [−29, 0]
  float pow2n;
  std::memcpy(&pow2n, &bits, sizeof pow2n);
  const float minus_E = (1.0f - pow2n) - pow2n * em1_r;
  return {std::copysign(minus_E / (2.0f - minus_E), x.v)};
}
#endif

// softcap's logit b · tanh(a · x) + c (a = scale / cap, b = cap, c = −row max; times log2 e for a base-2 exponent),
// fused into the softmax's exp pass. Where every lane has |a · x| ≤ 0.625 — a cap is a bound the logits seldom
// reach — tanh(w) = w · (1 + t·(c1 + t·(c2 + t·(c3 + t·c4)))), t = w², a minimax fit of tanh(w)/w on that range
// (2.3e-7 relative in float32, as the full tanh's 3e-7): 8 operations a vector where tanh takes ~23. Other vectors
// (a large logit, inf, NaN) take tanh above.
struct TanhLogit {
  static constexpr float kPolyBound = 0.625f;
  Vec a, b, c, bound2;
  TanhLogit(float a_, float b_, float c_)
      : a(Vec::broadcast(a_)), b(Vec::broadcast(b_)), c(Vec::broadcast(c_)),
        bound2(Vec::broadcast(kPolyBound * kPolyBound)) {}
  Vec operator()(Vec x, int64_t = 0) const {
    const Vec w = x * a, t = w * w;
    if (all_le(t, bound2)) {
      Vec q = fmadd(Vec::broadcast(0.0151953548f), t, Vec::broadcast(-0.0519478917f));
      q = fmadd(q, t, Vec::broadcast(0.133081749f));
      q = fmadd(q, t, Vec::broadcast(-0.333323419f));
      q = fmadd(q, t, Vec::broadcast(1.0f));
      return fmadd(w * q, b, c);
    }
    return fmadd(tanh(w), b, c);
  }
};

// ALiBi's base-2 exponent x − slope · |dist0 − c − lane| − shift of the vector at column c (flash_common.h's
// FusedLogit), −inf below −kAlibiDropBelow: ALiBi's far keys give many weights near 2^-125 whose products with V
// are subnormal numbers, slow on Intel cores. With the shift within kAlibiMaxGap of the row's largest logit
// (flash.cpp), what is dropped is under 2^-64 of its weight: nothing a float32 sum holding it can show.
constexpr float kAlibiMaxGap = 32.0f, kAlibiDropBelow = 96.0f;
struct AlibiLogit {
  Vec minus_slope, minus_shift, dist0;
  AlibiLogit(float slope, float shift, int32_t dist0_)
      : minus_slope(Vec::broadcast(-slope)), minus_shift(Vec::broadcast(-shift)), dist0(Vec::broadcast(dist0_)) {}
  Vec operator()(Vec x, int64_t c) const {
    alignas(64) static constexpr float kIota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const Vec dist = dist0 - (Vec::load(kIota) + Vec::broadcast(static_cast<float>(c)));  // exact below 2^24
    return fill_below(fmadd(minus_slope, abs(dist), x + minus_shift), Vec::broadcast(-kAlibiDropBelow),
                      Vec::broadcast(-std::numeric_limits<float>::infinity()));
  }
};

// x[c] = tanh(x[c])
inline void tanh_row(float* x, int64_t n) {
  constexpr int W = Vec::width;
  int64_t c = 0;
  for (; c + W <= n; c += W) tanh(Vec::load(x + c)).store(x + c);
  if (c < n) tanh(Vec::load_partial(x + c, n - c)).store_partial(x + c, n - c);
}

// Σ 2^(u(x[c], c)) over c < n, x[c] = 2^(u(x[c], c)): the base-2 exp pass with any exponent map u of the vector at
// column c (ShiftedLogit below; TanhLogit, AlibiLogit above).
template <class U>
inline float exp2_sum_with(const U& u, float* x, int64_t n) {
  constexpr int W = Vec::width;
  Vec sum0 = Vec::zero(), sum1 = Vec::zero();  // two chains hide the add latency
  int64_t c = 0;
  for (; c + 2 * W <= n; c += 2 * W) {
    const Vec e0 = exp2(u(Vec::load(x + c), c)), e1 = exp2(u(Vec::load(x + c + W), c + W));
    e0.store(x + c);
    e1.store(x + c + W);
    sum0 = sum0 + e0;
    sum1 = sum1 + e1;
  }
  for (; c + W <= n; c += W) {
    const Vec e = exp2(u(Vec::load(x + c), c));
    e.store(x + c);
    sum0 = sum0 + e;
  }
  if (c < n) {
    exp2(u(Vec::load_partial(x + c, n - c), c)).store_partial(x + c, n - c);
    sum1 = sum1 + Vec::load_partial(x + c, n - c);  // masked lanes of the 2^ are not 0
  }
  return reduce_add(sum0 + sum1);
}

// The plain softmax's exponent scale·x − shift.
struct ShiftedLogit {
  Vec a, s;
  ShiftedLogit(float scale, float shift) : a(Vec::broadcast(scale)), s(Vec::broadcast(-shift)) {}
  Vec operator()(Vec x, int64_t) const { return fmadd(x, a, s); }
};

// x[c] = 2^(scale·x[c] − shift); returns Σ x[c]: exp_shifted_sum for logits in base 2.
inline float exp2_shifted_sum(float* x, float shift, int64_t n, float scale = 1.0f) {
  return exp2_sum_with(ShiftedLogit(scale, shift), x, n);
}

// ---------------------------------------------------------------------------------------------------
// Row operations over n contiguous floats.
// ---------------------------------------------------------------------------------------------------

// Σ a[c]·b[c]
inline float dot(const float* a, const float* b, int64_t n) {
  constexpr int W = Vec::width;
  Vec acc0 = Vec::zero(), acc1 = Vec::zero();  // two chains hide the FMA latency
  int64_t c = 0;
  for (; c + 2 * W <= n; c += 2 * W) {
    acc0 = fmadd(Vec::load(a + c), Vec::load(b + c), acc0);
    acc1 = fmadd(Vec::load(a + c + W), Vec::load(b + c + W), acc1);
  }
  for (; c + W <= n; c += W) acc0 = fmadd(Vec::load(a + c), Vec::load(b + c), acc0);
  if (c < n) acc1 = fmadd(Vec::load_partial(a + c, n - c), Vec::load_partial(b + c, n - c), acc1);
  return reduce_add(acc0 + acc1);
}

// y[c] += alpha·x[c]
inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  constexpr int W = Vec::width;
  const Vec a = Vec::broadcast(alpha);
  int64_t c = 0;
  for (; c + W <= n; c += W) fmadd(a, Vec::load(x + c), Vec::load(y + c)).store(y + c);
  if (c < n) fmadd(a, Vec::load_partial(x + c, n - c), Vec::load_partial(y + c, n - c)).store_partial(y + c, n - c);
}

// x[c] *= alpha
inline void scale_row(float alpha, float* x, int64_t n) {
  constexpr int W = Vec::width;
  const Vec a = Vec::broadcast(alpha);
  int64_t c = 0;
  for (; c + W <= n; c += W) (a * Vec::load(x + c)).store(x + c);
  if (c < n) (a * Vec::load_partial(x + c, n - c)).store_partial(x + c, n - c);
}

inline void fill_row(float value, float* x, int64_t n) {
  for (int64_t c = 0; c < n; ++c) x[c] = value;
}

// max_c x[c]  (−inf for n = 0; NaN if any x[c] is NaN). Four running maxima: one would be a chain of
// dependent max steps (latency-bound), four keep the vector units busy.
inline float max_of(const float* x, int64_t n) {
  constexpr int W = Vec::width;
  Vec m0 = Vec::broadcast(kNegInf), m1 = m0, m2 = m0, m3 = m0;
  int64_t c = 0;
  for (; c + 4 * W <= n; c += 4 * W) {
    m0 = max(m0, Vec::load(x + c));
    m1 = max(m1, Vec::load(x + c + W));
    m2 = max(m2, Vec::load(x + c + 2 * W));
    m3 = max(m3, Vec::load(x + c + 3 * W));
  }
  for (; c + W <= n; c += W) m0 = max(m0, Vec::load(x + c));
  float result = reduce_max(max(max(m0, m1), max(m2, m3)));
  for (; c < n; ++c) result = max_nan(result, x[c]);
  return result;
}

// x[c] = exp(scale·x[c] − shift); returns Σ x[c]. With shift = max_c scale·x[c] every exponent is ≤ 0: no
// overflow. scale·x − shift is one fused multiply-add (exactly x − shift for scale = 1).
// Past kExactShiftFrom, the product scale·x is rounded on its own first (one more instruction): the shift is a row
// max taken as round(scale·x_max), and only then does that element's exponent come out exactly 0. A single FMA
// would leave the product's rounding residue, up to 2^-25 of |shift|, in the exponent: beyond ~2^31 that overflows
// exp (inf / inf = NaN for a row of finite logits), and far below it P is already off by more than a float32 ulp.
constexpr float kExactShiftFrom = 4096.0f;
inline bool exact_shift_needed(float shift, float scale) { return scale != 1.0f && !(std::fabs(shift) < kExactShiftFrom); }

inline float exp_shifted_sum(float* x, float shift, int64_t n, float scale = 1.0f) {
  constexpr int W = Vec::width;
  const Vec s = Vec::broadcast(-shift), a = Vec::broadcast(scale);
  Vec sum = Vec::zero();
  int64_t c = 0;
  if (exact_shift_needed(shift, scale)) {
    for (c = 0; c < n; ++c) x[c] *= scale;
    return exp_shifted_sum(x, shift, n, 1.0f);
  }
  for (; c + W <= n; c += W) {
    Vec e = exp(fmadd(Vec::load(x + c), a, s));
    e.store(x + c);
    sum = sum + e;
  }
  if (c < n) {
    Vec e = exp(fmadd(Vec::load_partial(x + c, n - c), a, s));
    e.store_partial(x + c, n - c);
    sum = sum + Vec::load_partial(x + c, n - c);  // masked lanes of e hold exp(0 - s), not 0
  }
  return reduce_add(sum);
}

// o[c] = Σ_{j<n} w[j] · V[j·ldv + c]   for c < d, overwriting o (kAccumulate: o[c] += the sum).
// o is held in registers (up to 4 vectors at a time) across the whole j loop, where an axpy per row of V
// would load and store it n times.
template <bool kAccumulate = false>
inline void weighted_row_sum(const float* w, const float* V, int64_t ldv, int64_t n, float* o, int64_t d) {
  constexpr int W = Vec::width, NV = 4;
  for (int64_t c0 = 0; c0 < d; c0 += NV * W) {
    const int64_t width = d - c0 < NV * W ? d - c0 : NV * W;
    Vec acc[NV] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
    if (kAccumulate)
      for (int k = 0; k * W < width; ++k) {
        const int64_t m = width - k * W;
        acc[k] = m >= W ? Vec::load(o + c0 + k * W) : Vec::load_partial(o + c0 + k * W, m);
      }
    if (width == NV * W) {
      for (int64_t j = 0; j < n; ++j) {
        const Vec wj = Vec::broadcast(w[j]);
        const float* v = V + j * ldv + c0;
        for (int k = 0; k < NV; ++k) acc[k] = fmadd(wj, Vec::load(v + k * W), acc[k]);
      }
      for (int k = 0; k < NV; ++k) acc[k].store(o + c0 + k * W);
    } else {  // the last columns: partial vectors
      for (int64_t j = 0; j < n; ++j) {
        const Vec wj = Vec::broadcast(w[j]);
        const float* v = V + j * ldv + c0;
        for (int k = 0; k * W < width; ++k) {
          const int64_t m = width - k * W;  // columns left from this vector on
          acc[k] = fmadd(wj, m >= W ? Vec::load(v + k * W) : Vec::load_partial(v + k * W, m), acc[k]);
        }
      }
      for (int k = 0; k * W < width; ++k) {
        const int64_t m = width - k * W;
        if (m >= W)
          acc[k].store(o + c0 + k * W);
        else
          acc[k].store_partial(o + c0 + k * W, m);
      }
    }
  }
}

// x[c] = exp(x[c])
inline void exp_row(float* x, int64_t n) {
  constexpr int W = Vec::width;
  int64_t c = 0;
  for (; c + W <= n; c += W) exp(Vec::load(x + c)).store(x + c);
  if (c < n) exp(Vec::load_partial(x + c, n - c)).store_partial(x + c, n - c);
}

// Softmax of one row of logits in place: p[c] = exp(x[c] − max) / Σ exp(x[c'] − max).
// The max shift is what makes it safe: the naive exp(x) of the assignment overflows for logits > 88.
// Non-finite logits (README, "Non-finite values"): a NaN or +inf makes the whole row NaN (exp(NaN) and
// exp(inf − inf) are NaN, and so is their sum); −inf is a weight of 0; a row of −inf only is all 0, as a
// row that sees no key (exp(−inf − (−inf)) would be NaN).
inline void softmax_row(float* x, int64_t n) {
  if (n == 0) return;
  const float m = max_of(x, n);
  if (m == kNegInf) return fill_row(0.0f, x, n);
  const float sum = exp_shifted_sum(x, m, n);
  scale_row(1.0f / sum, x, n);
}

// ---------------------------------------------------------------------------------------------------
// The register-blocked micro-kernel of every matrix product in the flash kernels.
//
//   C[r, 0:NV·W] = α_r · C[r, 0:NV·W] + Σ_{k<K} A[r, k] · B[k, 0:NV·W]       for r < R
//
// with α_r = alpha[r], or α_r = 0 (C is overwritten) when alpha is null. A[r, k] sits at
// A + r·a_row + k·a_col, so A may be a transposed view (a_row = 1); it is read one element at a time and
// broadcast. B is read one row of NV vectors at a time, rows ldb apart. The R × NV block of C stays in
// registers for the whole k loop, so each loaded B vector feeds R FMAs and each broadcast A element NV.
// R · NV accumulators + NV B vectors + 1 broadcast must fit the register file (32 zmm, 16 ymm).
// kRowsAdjacent: a_row is 1, known when compiling — the R broadcasts of a step then address A from one pointer
// with constant offsets, where a row stride known only at run time takes R registers of addresses (more than
// x86-64 has beside the loop's own, for R = 12: the compiler spilled them inside the k loop).
// row_max (optional): a running maximum of each row's first max_vecs vectors of C, one vector a row (row_max[r·W ..]),
// taken from the registers as they are stored (max_skip_nan: NaN lanes skipped) — the flash forward's row max of S
// without reading S again.
// ---------------------------------------------------------------------------------------------------
template <int R, int NV, bool kRowsAdjacent = false>
inline void micro_gemm(int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb,
                       float* C, int64_t ldc, const float* alpha, float* row_max = nullptr, int max_vecs = 0) {
  constexpr int W = Vec::width;
  if constexpr (kRowsAdjacent) a_row = 1;
  Vec acc[R][NV];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) {
    const Vec a = Vec::broadcast(alpha ? alpha[r] : 0.0f);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = alpha ? a * Vec::load(C + r * ldc + v * W) : Vec::zero();
  }
  for (int64_t k = 0; k < K; ++k, A += a_col, B += ldb) {
    Vec b[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = Vec::load(B + v * W);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const Vec a = Vec::broadcast(A[r * a_row]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(a, b[v], acc[r][v]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v].store(C + r * ldc + v * W);
  if (row_max) {
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      Vec m = Vec::load(row_max + r * W);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v)
        if (v < max_vecs) m = max_skip_nan(acc[r][v], m);
      m.store(row_max + r * W);
    }
  }
}

#if defined(CS149_ISA_AVX512)
// float32 results into bf16 (outputs, gradients), 16 values an instruction sequence instead of one c10::BFloat16
// conversion each. Rounding as c10::BFloat16 does it, bit for bit: to nearest even by integer
// arithmetic (bits + 0x7FFF + the kept part's lowest bit, then the high half), subnormals kept, NaN as 0x7FC0.
// (vcvtneps2bf16 would read subnormal inputs as zero.)
inline __m256i bf16_round(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}
// y[c] = bf16(scale·x[c]) for c < n.
inline void store_scaled_bf16(const float* x, float scale, int64_t n, uint16_t* y) {
  const __m512 a = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 lanes = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1u);
    _mm256_mask_storeu_epi16(y + c, lanes, bf16_round(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(lanes, x + c))));
  }
}
#endif

// dst[c · ld_dst + r] = scale · src[r · ld_src + c] for r < rows, c < cols: a block transposed, as the flash
// kernel's packing of K_jᵀ (keys become columns) and of Q's column-major row groups need it. Element by element
// that is a strided store or load per value, as much work as the products themselves for short sequences (BERT's
// 128 tokens: ~25 % of a call on a 2-core EPYC); with AVX-512, blocks of 16 × 16 go through registers.
#if defined(CS149_ISA_AVX512)
// r[i] = column i of the 16 × 16 block whose rows are r[0..15] (unpack pairs, then 64-bit pairs, then 128-bit
// lanes twice).
inline void transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // Now, in each 128-bit lane L of r[4q + j]: rows 4q..4q+3 of column 4L + j. Two lane shuffles gather each column.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}
#endif

#if defined(CS149_ISA_AVX512)
// The blocks of scale · srcᵀ, 16 × 16 at a time through registers: store(block, r0, nr, c0, nc) gets block[i] =
// scale · column c0 + i of src over its rows [r0, r0 + nr) (lanes past nr zero), for i < nc ≤ 16.
template <class Store>
inline void for_each_transposed_block(const float* src, int64_t ld_src, int64_t rows, int64_t cols, float scale,
                                      const Store& store) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t nr = std::min<int64_t>(16, rows - r0);
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const int64_t nc = std::min<int64_t>(16, cols - c0);
      const __mmask16 col_lanes = (__mmask16)((1u << nc) - 1u);
      __m512 block[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        block[i] = i < nr ? _mm512_mul_ps(s, _mm512_maskz_loadu_ps(col_lanes, src + (r0 + i) * ld_src + c0))
                          : _mm512_setzero_ps();
      transpose16x16(block);
      store(block, r0, nr, c0, nc);
    }
  }
}
#endif

inline void transpose_block(const float* src, int64_t ld_src, int64_t rows, int64_t cols, float scale, float* dst,
                            int64_t ld_dst) {
#if defined(CS149_ISA_AVX512)
  for_each_transposed_block(src, ld_src, rows, cols, scale,
                            [&](const __m512* block, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
                              const __mmask16 row_lanes = (__mmask16)((1u << nr) - 1u);
#pragma GCC unroll 16
                              for (int i = 0; i < 16; ++i)
                                if (i < nc) _mm512_mask_storeu_ps(dst + (c0 + i) * ld_dst + r0, row_lanes, block[i]);
                            });
#else
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = scale * src[r * ld_src + c];
#endif
}

}  // namespace CS149_ISA
}  // namespace cs149gpt
