// Does a vector instruction whose result underflows cost a microcode assist on this CPU?
//
// The online softmax takes exp of every logit a tile holds, and the causal mask's hidden keys are −inf logits:
// the diagonal tiles hold many. simd.h's exp used to clamp the argument to −150 and let scalef underflow to 0;
// this probe times that old 2^t against the current one (lanes below −125 masked to 0, never computed as a
// subnormal) on inputs whose results are normal (0), underflow to 0 (−inf), or are subnormal (−130), with
// MXCSR's flush-to-zero off (the default, and what PyTorch leaves) and on.
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
  return 0;
}
