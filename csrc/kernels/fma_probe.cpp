// The machine's FMA peak, measured: the yardstick the benchmark reports its GFLOP/s against.
//
// Each thread runs kChains independent chains of vector FMAs, acc = acc · a + b, so the FMA latency is
// hidden (latency 4 × 2 FMA ports = 8 chains in flight at least) and the loop is bound only by FMA
// throughput. Returns the number of floating-point operations done (2 per lane per FMA).
#include "../attention.h"
#include "bf16_gemm.h"
#include "simd.h"

#include <omp.h>

namespace cs149gpt {
namespace CS149_ISA {

double fma_probe(int64_t iterations, int num_threads) {
  constexpr int kChains = 12;
  double sink = 0.0;
#pragma omp parallel num_threads(num_threads) reduction(+ : sink)
  {
    Vec acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = Vec::broadcast(1.0f + c * 1e-3f);
    const Vec a = Vec::broadcast(0.999999f), b = Vec::broadcast(1e-7f);
    for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
      for (int c = 0; c < kChains; ++c) acc[c] = fmadd(acc[c], a, b);  // a recurrence: nothing to hoist
    }
    Vec total = Vec::zero();
    for (int c = 0; c < kChains; ++c) total = total + acc[c];
    sink += reduce_add(total);
  }
  // sink is ≈ kChains · threads · lanes, never 0: returned through a multiplication by 0 it keeps the work.
  return static_cast<double>(iterations) * kChains * Vec::width * 2 * num_threads + 0.0 * sink;
}

// The machine's read bandwidth, measured: the yardstick of the decode benchmark (decoding reads a KV cache once
// and is bound by memory). Sums n floats with vector loads into 8 independent accumulators — a read that nothing
// but the memory limits — the threads taking equal contiguous chunks, as the decode kernel's tasks do. Returns the
// sum (so the reads cannot be dropped).
double read_probe(const float* x, int64_t n, int num_threads) {
  constexpr int W = Vec::width, kChains = 8;
  double total = 0.0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total) if (num_threads > 1)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t chunk = (n / threads) / (W * kChains) * (W * kChains);
    const int64_t begin = t * chunk, end = t + 1 == threads ? n : begin + chunk;
    Vec acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = Vec::zero();
    int64_t i = begin;
    for (; i + W * kChains <= end; i += W * kChains) {
#pragma GCC unroll 8
      for (int c = 0; c < kChains; ++c) acc[c] = acc[c] + Vec::load(x + i + c * W);
    }
    float rest = 0.0f;
    for (; i < end; ++i) rest += x[i];
    Vec sum = Vec::zero();
    for (int c = 0; c < kChains; ++c) sum = sum + acc[c];
    total += reduce_add(sum) + rest;
  }
  return total;
}

#if defined(CS149_ISA_BF16_DOT)
// The bf16 dot-product peak, the yardstick of the bf16 path: FLOPs done in `iterations` rounds on each of
// num_threads threads.
//   AMX: 4 tdpbf16ps into 4 independent C tiles per round, 16·16·32·2 FLOPs each, operands loaded once.
//   vdpbf16ps: 24 independent accumulator chains, 16 lanes · 2 products · 2 FLOPs each.
double bf16_dot_probe(int64_t iterations, int num_threads) {
  double sink = 0.0;
#pragma omp parallel num_threads(num_threads) reduction(+ : sink)
  {
#if defined(CS149_ISA_AMX)
    alignas(64) bf16_bits operand[16 * 32];
    for (int i = 0; i < 16 * 32; ++i) operand[i] = 0x3F80;  // 1.0
    alignas(64) float c[16 * 16];
    {
      const DotScope tiles;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(4, operand, 64);
      _tile_loadd(5, operand, 64);
      _tile_loadd(6, operand, 64);
      _tile_loadd(7, operand, 64);
      for (int64_t it = 0; it < iterations; ++it) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c, 64);
    }
    sink += c[0];
#else
    constexpr int kChains = 24;
    __m512 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1.0f + i * 1e-3f);
    const __m512i a = _mm512_set1_epi32(0x3F803F80), b = _mm512_set1_epi32(0x33D633D6);  // bf16 1.0, 1e-7
    for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 24
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)b);
    }
    __m512 total = _mm512_setzero_ps();
    for (int i = 0; i < kChains; ++i) total = _mm512_add_ps(total, acc[i]);
    sink += _mm512_reduce_add_ps(total);
#endif
  }
#if defined(CS149_ISA_AMX)
  const double flops_per_round = 4.0 * 16 * 16 * 32 * 2;
#else
  const double flops_per_round = 24.0 * 16 * 2 * 2;
#endif
  return static_cast<double>(iterations) * flops_per_round * num_threads + 0.0 * sink;
}
#endif

}  // namespace CS149_ISA
}  // namespace cs149gpt
