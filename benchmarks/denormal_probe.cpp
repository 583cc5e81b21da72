// Does a vector instruction whose result underflows cost a microcode assist on this CPU?
//
// The online softmax takes exp of every logit a tile holds, and the causal mask's hidden keys are −inf logits:
// the diagonal tiles hold many. simd.h's exp used to clamp the argument to −150 and let scalef underflow to 0;
// this probe times that old 2^t against the current one (lanes below −125 masked to 0, never computed as a
// subnormal) on inputs whose results are normal (0), underflow to 0 (−inf), or are subnormal (−130), with
// MXCSR's flush-to-zero off (the default, and what PyTorch leaves) and on.
// It also times two cheaper forms for the softmax (whose arguments are ≤ 0): the clamps dropped, lanes below −125
// only masked off in scalef (do masked-off lanes that would underflow still take the assist?), and 2^f on
// [0, 1) from vreduceps (t − floor t, one instruction) with scalef's own floor of t, and checks their accuracy.
//   g++ -O2 -march=native -o /tmp/denormal_probe benchmarks/denormal_probe.cpp && /tmp/denormal_probe
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

static __m512 poly(__m512 t, __m512* n) {  // 2^f for f = t − round(t), degree 4 (simd.h's exp2_poly<4>)
  *n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, *n);
  __m512 y = _mm512_set1_ps(9.570068877e-03f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.591780848e-02f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.402474506e-01f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931218213e-01f));
  return _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999992616e-01f));
}
static __m512 exp2_underflowing(__m512 t) {  // the old one: clamp at −150, scalef underflows
  t = _mm512_max_ps(_mm512_set1_ps(-150.0f), _mm512_min_ps(_mm512_set1_ps(129.0f), t));
  __m512 n;
  const __m512 y = poly(t, &n);
  return _mm512_scalef_ps(y, n);
}
static __m512 exp2_masked(__m512 t) {  // the new one: lanes below −125 zeroed, nothing subnormal computed
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
  t = _mm512_max_ps(_mm512_set1_ps(-125.0f), _mm512_min_ps(_mm512_set1_ps(129.0f), t));
  __m512 n;
  const __m512 y = poly(t, &n);
  return _mm512_maskz_scalef_ps(normal, y, n);
}

static __m512 exp2_mask_only(__m512 t) {  // no clamps: lanes below −125 only masked off in scalef
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
  __m512 n;
  const __m512 y = poly(t, &n);
  return _mm512_maskz_scalef_ps(normal, y, n);
}
static __m512 exp2_reduce(__m512 t) {  // f = t − floor(t) by vreduceps, 2^f on [0, 1), scalef floors t itself
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
  const __m512 f = _mm512_reduce_ps(t, 0x09);  // round down, no precision exception
  __m512 y = _mm512_set1_ps(1.3534164987504482e-02f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.201147496700287e-02f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.414427399635315e-01f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.930038332939148e-01f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0000026226043701f));
  return _mm512_maskz_scalef_ps(normal, y, t);
}

template <class F>
static double ns_per_vector(const std::vector<float>& x, std::vector<float>& y, F f) {
  const int reps = 2000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < x.size(); i += 16) _mm512_storeu_ps(&y[i], f(_mm512_loadu_ps(&x[i])));
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / (reps * (x.size() / 16.0));
}

int main() {
  std::vector<float> y(4096);
  const struct { const char* name; float value; } inputs[] = {
      {"2^0 (normal)", 0.0f}, {"2^-inf (underflow to 0)", -INFINITY}, {"2^-130 (subnormal)", -130.0f}};
  for (int ftz = 0; ftz <= 1; ++ftz) {
    _MM_SET_FLUSH_ZERO_MODE(ftz ? _MM_FLUSH_ZERO_ON : _MM_FLUSH_ZERO_OFF);
    for (const auto& in : inputs) {
      std::vector<float> x(4096, in.value);
      const double old_ns = ns_per_vector(x, y, exp2_underflowing), new_ns = ns_per_vector(x, y, exp2_masked);
      std::printf("FTZ %-3s  %-26s  clamp-and-underflow %7.2f ns/vector   masked %6.2f ns/vector   (y = %g)\n",
                  ftz ? "on" : "off", in.name, old_ns, new_ns, y[0]);
    }
  }
  // The softmax forms: time on −inf (masked keys), on a realistic spread [−20, 0], and accuracy on [−125, 0].
  _MM_SET_FLUSH_ZERO_MODE(_MM_FLUSH_ZERO_OFF);
  std::vector<float> spread(4096), dense(1 << 16);
  for (size_t i = 0; i < spread.size(); ++i) spread[i] = -20.0f * float(i) / spread.size();
  for (size_t i = 0; i < dense.size(); ++i) dense[i] = -125.0f * float(i) / dense.size();
  std::vector<float> neg_inf(4096, -INFINITY), out(dense.size());
  const struct { const char* name; __m512 (*f)(__m512); } forms[] = {
      {"masked (simd.h now)", exp2_masked}, {"mask only, no clamps", exp2_mask_only}, {"vreduceps", exp2_reduce}};
  for (const auto& form : forms) {
    const double t_inf = ns_per_vector(neg_inf, y, form.f), t_spread = ns_per_vector(spread, y, form.f);
    for (size_t i = 0; i < dense.size(); i += 16) _mm512_storeu_ps(&out[i], form.f(_mm512_loadu_ps(&dense[i])));
    double worst = 0;
    for (size_t i = 0; i < dense.size(); ++i)
      if (dense[i] >= -124.0f) worst = std::max(worst, std::abs(out[i] / std::exp2(double(dense[i])) - 1.0));
    alignas(64) float special[16] = {-INFINITY, NAN, -200.0f, -126.0f, 0.0f, -0.0f, 128.5f, INFINITY};
    alignas(64) float got[16];
    _mm512_store_ps(got, form.f(_mm512_load_ps(special)));
    std::printf("softmax form %-22s  -inf %6.2f ns/vector  [-20,0] %6.2f ns/vector  max rel error %.2e  "
                "2^(-inf, nan, -200, -126, 0, -0, 128.5, inf) = %g %g %g %g %g %g %g %g\n", form.name, t_inf, t_spread,
                worst, got[0], got[1], got[2], got[3], got[4], got[5], got[6], got[7]);
  }
  return 0;
}
