// Where the bf16 flash forward's time goes on one core (AMX or vdpbf16ps): the real kernel (flash_bf16.cpp)
// timed whole, then with phases left out, and its micro-kernels alone on cache-resident data.
// A measuring tool for issue 9, not part of the extension. Build and run (needs torch's headers for c10):
//   g++ -O3 -fopenmp -I$(python3 -c 'import torch.utils.cpp_extension as c; print(c.include_paths()[0])') \
//       benchmarks/amx_phases.cpp -o /tmp/amx_phases && /tmp/amx_phases [amx|dot]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../csrc/attention.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,avx2,fma,bmi2,f16c")
#define CS149_ISA amx
#define CS149_ISA_AVX512
#define CS149_ISA_BF16_DOT
#define CS149_ISA_AMX
#include "../csrc/kernels/flash_bf16.cpp"

using namespace cs149gpt;
using namespace cs149gpt::amx;
using namespace cs149gpt::amx::flash_bf16;

static double seconds_per_call(const std::function<void()>& f, double min_time = 0.25) {
  f();  // warm
  int64_t calls = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double elapsed = 0;
  do {
    f();
    ++calls;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (elapsed < min_time);
  return elapsed / calls;
}

// The kernel's query_tile with phases switched off (QK: S = Q Kᵀ; SM: the online softmax; PV: O += P V).
template <bool QK, bool SM, bool PV>
void query_tile_phases(const AttentionParams& p, const Layout& L, int64_t i0, const bf16_bits* kt_all,
                       const bf16_bits* v_all, float* scratch) {
  const int64_t d = p.head_dim, rows = std::min(L.Br, p.q_len - i0), groups = (rows + G - 1) / G;
  bf16_bits* Qi = reinterpret_cast<bf16_bits*>(scratch + L.q_off);
  bf16_bits* Pb = reinterpret_cast<bf16_bits*>(scratch + L.p_off);
  float *S = scratch + L.s_off, *Oi = scratch + L.o_off, *m = scratch + L.m_off, *l = scratch + L.l_off;
  float *alpha = scratch + L.alpha_off, *m_new = alpha + G;
  int64_t visible[G];
  const bf16_bits* Q = reinterpret_cast<const bf16_bits*>(p.q) + i0 * p.q_strides[2];
  std::fill(Qi, Qi + groups * G * L.d_k, bf16_bits{0});
  for (int64_t r = 0; r < rows; ++r) std::copy(Q + r * p.q_strides[2], Q + r * p.q_strides[2] + d, Qi + r * L.d_k);
  fill_row(kNegInf, m, groups * G);
  fill_row(0.0f, l, groups * G);
  fill_row(0.0f, Oi, groups * G * L.d_n);
  for (int64_t j0 = 0, j = 0; j0 < p.kv_len; j0 += L.Bc, ++j) {
    const int64_t cols = std::min(L.Bc, p.kv_len - j0);
    const bf16_bits* KTj = kt_all + j * L.kt_tile;
    const bf16_bits* Vj = v_all + j * L.v_tile;
    for (int64_t g0 = 0; g0 < rows; g0 += G) {
      const int64_t n_keys = cols;
      if (QK) bf16_gemm(G, round_up(n_keys, kDotCols), L.d_k, Qi + g0 * L.d_k, L.d_k, KTj, L.Bc_pad, S, L.Bc_pad, false);
      const int64_t k_keys = round_up(n_keys, kDotK);
      for (int64_t r = 0; r < G; ++r) visible[r] = n_keys;
      if (SM) {
        online_softmax(S, L.Bc_pad, G, n_keys, visible, p.scale, m + g0, l + g0, alpha, m_new,
                       PToBf16{Pb, L.Bc_pad, k_keys});
        float* Og = Oi + g0 * L.d_n;
        for (int64_t r = 0; r < G; ++r) scale_row(alpha[r], Og + r * L.d_n, L.d_n);
      }
      if (PV) bf16_gemm(G, L.d_n, k_keys, Pb, L.Bc_pad, Vj, L.d_n, Oi + g0 * L.d_n, L.d_n, true);
    }
  }
  if (SM) finish_rows<c10::BFloat16>(p, 0, 0, i0, rows, Oi, L.d_n, m, l);
}


// The AMX block this kernel used before (a 2 × 2 block of C tiles, one A and one B pair reloaded every k step),
// kept here to compare with bf16_gemm.h's column block in the same run.
inline void amx_2x2_reference(int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B, int64_t ldb, float* C,
                              int64_t ldc, bool accumulate) {
  const int64_t as = lda * 2, bs = ldb * 4, cs = ldc * 4;
  if (accumulate) {
    _tile_loadd(0, C, cs); _tile_loadd(2, C + 16 * ldc, cs); _tile_loadd(1, C + 16, cs); _tile_loadd(3, C + 16 * ldc + 16, cs);
  } else {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += kDotK) {
    const bf16_bits* Bk = B + (k / 2) * ldb * 2;
    _tile_loadd(4, A + k, as);
    _tile_loadd(5, A + 16 * lda + k, as);
    _tile_loadd(6, Bk, bs);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, Bk + 32, bs);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, C, cs); _tile_stored(2, C + 16 * ldc, cs); _tile_stored(1, C + 16, cs); _tile_stored(3, C + 16 * ldc + 16, cs);
}
inline void gemm_2x2_reference(int64_t M, int64_t N, int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B,
                               int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t m = 0; m < M; m += 32)
    for (int64_t n = 0; n < N; n += 32) amx_2x2_reference(K, A + m * lda, lda, B + n * 2, ldb, C + m * ldc + n, ldc, accumulate);
}

// The products and the softmax pieces alone, on cache-resident data.
void micro_kernels() {
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  const DotScope tiles;
  for (int64_t d : {64, 128}) {
    for (int64_t M : {64, 128}) {
      const int64_t Bc = 256;
      std::vector<bf16_bits> A(M * std::max(d, Bc)), B(d * Bc), V(Bc * d);
      for (auto* v : {&A, &B, &V})
        for (auto& x : *v) x = c10::BFloat16(normal(rng) * 0.3f).x;
      std::vector<float> S(M * Bc), O(M * d, 0.f);
      auto report = [&](const char* name, double s) {
        std::printf("d=%3ld M=%3ld %-26s %6.0f GFLOP/s\n", d, M, name, 2.0 * M * Bc * d / s / 1e9);
      };
      report("QK bf16_gemm", seconds_per_call([&] { bf16_gemm(M, Bc, d, A.data(), d, B.data(), Bc, S.data(), Bc, false); }, 0.1));
      report("QK 2x2 reference", seconds_per_call([&] { gemm_2x2_reference(M, Bc, d, A.data(), d, B.data(), Bc, S.data(), Bc, false); }, 0.1));
      report("PV bf16_gemm", seconds_per_call([&] { bf16_gemm(M, d, Bc, A.data(), Bc, V.data(), d, O.data(), d, true); }, 0.1));
      report("PV 2x2 reference", seconds_per_call([&] { gemm_2x2_reference(M, d, Bc, A.data(), Bc, V.data(), d, O.data(), d, true); }, 0.1));
    }
  }
  const int64_t Bc = 256, R = 64;
  std::vector<float> S(R * Bc);
  for (auto& x : S) x = normal(rng) * 3;
  std::vector<bf16_bits> P(R * Bc);
  volatile float sink = 0;
  auto per_score = [&](double s) { return s * 1e9 / (R * Bc); };
  std::printf("max_of                   %.3f ns/score\n", per_score(seconds_per_call([&] {
    for (int r = 0; r < R; ++r) sink = sink + max_of(S.data() + r * Bc, Bc); }, 0.1)));
  std::printf("exp_shifted_sum_to_bf16  %.3f ns/score\n", per_score(seconds_per_call([&] {
    for (int r = 0; r < R; ++r) sink = sink + exp_shifted_sum_to_bf16(S.data() + r * Bc, 9.f, Bc, 1.f, P.data() + r * Bc, Bc); }, 0.1)));
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    std::printf("AMX refused\n");
    return 1;
  }
  (void)argc;
  (void)argv;
  // Tile-product throughput: 4 and 6 independent accumulators.
  {
    alignas(64) bf16_bits operand[16 * 32];
    for (auto& x : operand) x = 0x3F80;
    alignas(64) float c[16 * 16];
    const DotScope tiles;
    const int64_t iters = 1 << 20;
    for (int chains : {4, 6}) {
      const double s = seconds_per_call([&] {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
        _tile_loadd(6, operand, 64);
        _tile_loadd(7, operand, 64);
        if (chains == 4)
          for (int64_t it = 0; it < iters; ++it) {
            _tile_dpbf16ps(0, 6, 7); _tile_dpbf16ps(1, 6, 7); _tile_dpbf16ps(2, 6, 7); _tile_dpbf16ps(3, 6, 7);
          }
        else
          for (int64_t it = 0; it < iters; ++it) {
            _tile_dpbf16ps(0, 6, 7); _tile_dpbf16ps(1, 6, 7); _tile_dpbf16ps(2, 6, 7);
            _tile_dpbf16ps(3, 6, 7); _tile_dpbf16ps(4, 6, 7); _tile_dpbf16ps(5, 6, 7);
          }
        _tile_stored(0, c, 64);
      });
      const double dps = double(iters) * chains / s;
      std::printf("probe %d chains: %.0f GFLOP/s, %.2f ns per tdpbf16ps\n", chains, dps * 16384 / 1e9, 1e9 / dps);
    }
  }
  micro_kernels();
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (int64_t d : {64, 128}) {
    // The whole kernel, one head, 1 thread: Nq = Nk = 2048, then phases left out.
    const int64_t N = 2048;
    std::vector<bf16_bits> q(N * d), k(N * d), v(N * d), out(N * d);
    for (auto* t : {&q, &k, &v})
      for (auto& x : *t) x = c10::BFloat16(normal(rng)).x;
    AttentionParams p;
    p.q = q.data(); p.k = k.data(); p.v = v.data(); p.out = out.data();
    p.dtype = DType::bf16;
    for (auto* st : {p.q_strides, p.k_strides, p.v_strides, p.out_strides}) {
      st[0] = N * d; st[1] = N * d; st[2] = d;
    }
    p.batch = p.num_heads = p.num_kv_heads = 1;
    p.q_len = p.kv_len = N;
    p.head_dim = d;
    p.scale = 1.0f / std::sqrt(float(d));
    p.num_threads = 1;
    const double flops = 4.0 * N * N * d;
    for (int64_t Bc : {128, 256, 512}) {
      for (int64_t Br : {64, 128, 256}) {
        p.block_q = Br; p.block_k = Bc;
        const Layout L(p);
        std::vector<float> ws(workspace_floats(p) + 64);
        const double s = seconds_per_call([&] { run(p, ws.data()); });
        std::printf("d=%3ld  full kernel Br=%3ld Bc=%3ld: %.0f GFLOP/s (%.3f ns per score)\n", d, Br, Bc,
                    flops / s / 1e9, s * 1e9 / (N * N));
      }
    }
    for (int64_t Bc : {256}) {
      p.block_q = 128; p.block_k = Bc;
      const Layout L(p);
      std::vector<float> ws(workspace_floats(p) + 64);
      run(p, ws.data());  // packs K, V into ws
      const bf16_bits* kt_all = reinterpret_cast<bf16_bits*>(ws.data());
      const bf16_bits* v_all = reinterpret_cast<bf16_bits*>(ws.data() + L.kt_floats);
      float* scratch = ws.data() + L.kt_floats + L.v_floats + L.flags_floats;
      const DotScope tiles;
      auto time_phases = [&](const char* name, auto tile_fn) {
        const double s = seconds_per_call([&] {
          for (int64_t i0 = 0; i0 < N; i0 += L.Br) tile_fn(i0);
        });
        std::printf("d=%3ld  Bc=%3ld phases %-14s %.3f ns per score\n", d, Bc, name, s * 1e9 / (N * N));
      };
      time_phases("QK+SM+PV", [&](int64_t i0) { query_tile_phases<true, true, true>(p, L, i0, kt_all, v_all, scratch); });
      time_phases("QK", [&](int64_t i0) { query_tile_phases<true, false, false>(p, L, i0, kt_all, v_all, scratch); });
      time_phases("SM", [&](int64_t i0) { query_tile_phases<false, true, false>(p, L, i0, kt_all, v_all, scratch); });
      time_phases("PV", [&](int64_t i0) { query_tile_phases<false, false, true>(p, L, i0, kt_all, v_all, scratch); });
      time_phases("QK+SM", [&](int64_t i0) { query_tile_phases<true, true, false>(p, L, i0, kt_all, v_all, scratch); });
      time_phases("QK+PV", [&](int64_t i0) { query_tile_phases<true, false, true>(p, L, i0, kt_all, v_all, scratch); });
    }
  }
  return 0;
}
