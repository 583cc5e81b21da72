// The machine's FMA peak, measured: the yardstick the benchmark reports its GFLOP/s against.
//
// Each thread runs kChains independent chains of vector FMAs, acc = acc · a + b, so the FMA latency is
// hidden (latency 4 × 2 FMA ports = 8 chains in flight at least) and the loop is bound only by FMA
// throughput. Returns the number of floating-point operations done (2 per lane per FMA).
#include "../attention.h"
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

}  // namespace CS149_ISA
}  // namespace cs149gpt
