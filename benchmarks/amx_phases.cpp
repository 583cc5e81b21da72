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
// The alternative measured against bf16_gemm.h's 2 × 2 blocks: 64 × 16 column blocks, one B tile per k step
// feeding four products, A and B alternating between tile pairs.
// One k step of the column block below: B rows [k, k + 32) into tile TB, then the four 16-row slices of A
// through tiles 4 and 5 in turn, each multiplied into its C tile (0–3). A macro, not a template: the tile
// intrinsics take the register number as a literal.
#define CS149_AMX_K_STEP(TB, A, lda, a_stride, Bk, b_stride) \
  do {                                                       \
    _tile_loadd(TB, Bk, b_stride);                           \
    _tile_loadd(4, A, a_stride);                             \
    _tile_dpbf16ps(0, 4, TB);                                \
    _tile_loadd(5, (A) + 16 * (lda), a_stride);              \
    _tile_dpbf16ps(1, 5, TB);                                \
    _tile_loadd(4, (A) + 32 * (lda), a_stride);              \
    _tile_dpbf16ps(2, 4, TB);                                \
    _tile_loadd(5, (A) + 48 * (lda), a_stride);              \
    _tile_dpbf16ps(3, 5, TB);                                \
  } while (0)

// C[0:64, n0:n0+16] (+)= A[0:64, :K] · B[:K, n0:n0+16]: four C tiles stacked (tiles 0–3), one B tile per k step
// feeding all four. Tile registers are not renamed: a load into a tile waits for the products still reading it.
// So B alternates between tiles 6 and 7 from one k step to the next, and A between 4 and 5 — measured on the
// device host's Xeon, 5–15 % faster than a 2 × 2 block of C tiles with one A and one B pair (amx_phases.cpp).
inline void amx_column_block(int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B, int64_t ldb, float* C,
                             int64_t ldc, bool accumulate) {
  const int64_t a_stride = lda * 2, b_stride = 64, c_stride = ldc * 4;  // bytes
  if (accumulate) {
    _tile_loadd(0, C, c_stride);
    _tile_loadd(1, C + 16 * ldc, c_stride);
    _tile_loadd(2, C + 32 * ldc, c_stride);
    _tile_loadd(3, C + 48 * ldc, c_stride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  int64_t k = 0;
  for (; k + 2 * kDotK <= K; k += 2 * kDotK) {
    CS149_AMX_K_STEP(6, A + k, lda, a_stride, B + b_tile_offset(k, 0, ldb), b_stride);
    CS149_AMX_K_STEP(7, A + k + kDotK, lda, a_stride, B + b_tile_offset(k + kDotK, 0, ldb), b_stride);
  }
  if (k < K) CS149_AMX_K_STEP(6, A + k, lda, a_stride, B + b_tile_offset(k, 0, ldb), b_stride);
  _tile_stored(0, C, c_stride);
  _tile_stored(1, C + 16 * ldc, c_stride);
  _tile_stored(2, C + 32 * ldc, c_stride);
  _tile_stored(3, C + 48 * ldc, c_stride);
}

inline void gemm_column_blocks(int64_t M, int64_t N, int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B,
                               int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t m = 0; m < M; m += 64)
    for (int64_t n = 0; n < N; n += 16) amx_column_block(K, A + m * lda, lda, B + b_tile_offset(0, n, ldb), ldb, C + m * ldc + n, ldc, accumulate);
}
#undef CS149_AMX_K_STEP

// Loop-order, K-chunking and prefetch variants of bf16_gemm (same 2 × 2 blocks of C tiles), to find where the
// tile loads come from: with 2 × 2 blocks every tdpbf16ps (16 cycles) needs one 1 KB tile load, 64 B a cycle,
// which L1 delivers and L2 barely does; tile registers are not renamed, so a slow load stalls the products.
//   kNOuter: column blocks outer, row blocks inner (a B strip is reused at once by every row block, from L1).
//   kChunk:  K in chunks of this many (0: whole), every block over one chunk before the next chunk, so the
//            chunk's A and B stay in L1 (C loaded and stored once per chunk instead).
//   kPrefetch: the next k step's A rows and B tiles prefetched into L1 during this one.
template <int NB, bool kPrefetch>
inline void amx_block_pf(int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B, int64_t ldb, float* C,
                         int64_t ldc, bool accumulate) {
  const int64_t a_stride = lda * 2, b_stride = 64, c_stride = ldc * 4;
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
  for (int64_t k = 0; k < K; k += kDotK) {
    if (kPrefetch && k + kDotK < K) {
      const char* next_b = reinterpret_cast<const char*>(B + b_tile_offset(k + kDotK, 0, ldb));
      for (int i = 0; i < 16 * NB; ++i) _mm_prefetch(next_b + 64 * i, _MM_HINT_T0);
      for (int r = 0; r < 32; ++r) _mm_prefetch(reinterpret_cast<const char*>(A + r * lda + k + kDotK), _MM_HINT_T0);
    }
    _tile_loadd(4, A + k, a_stride);
    const bf16_bits* Bk = B + b_tile_offset(k, 0, ldb);
    _tile_loadd(6, Bk, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, A + 16 * lda + k, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    if (NB == 2) {
      _tile_loadd(7, Bk + 512, b_stride);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, C, c_stride);
  _tile_stored(2, C + 16 * ldc, c_stride);
  if (NB == 2) {
    _tile_stored(1, C + 16, c_stride);
    _tile_stored(3, C + 16 * ldc + 16, c_stride);
  }
}

template <bool kNOuter, int kChunk, bool kPrefetch>
void gemm_variant(int64_t M, int64_t N, int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B, int64_t ldb,
                  float* C, int64_t ldc, bool accumulate) {
  const int64_t chunk = kChunk > 0 ? kChunk : K;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t kc = std::min(chunk, K - k0);
    const bool acc = accumulate || k0 > 0;
    auto block = [&](int64_t m, int64_t n) {
      const bf16_bits* Am = A + m * lda + k0;
      const bf16_bits* Bn = B + b_tile_offset(k0, n, ldb);
      float* Cmn = C + m * ldc + n;
      if (n + 32 <= N)
        amx_block_pf<2, kPrefetch>(kc, Am, lda, Bn, ldb, Cmn, ldc, acc);
      else
        amx_block_pf<1, kPrefetch>(kc, Am, lda, Bn, ldb, Cmn, ldc, acc);
    };
    if (kNOuter) {
      for (int64_t n = 0; n < N; n += 32)
        for (int64_t m = 0; m < M; m += 32) block(m, n);
    } else {
      for (int64_t m = 0; m < M; m += 32)
        for (int64_t n = 0; n < N; n += 32) block(m, n);
    }
  }
}

using Gemm = void (*)(int64_t, int64_t, int64_t, const bf16_bits*, int64_t, const bf16_bits*, int64_t, float*,
                     int64_t, bool);
template <bool QK, bool SM, bool PV, Gemm gemm = bf16_gemm, Gemm pv_gemm = gemm>
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
      if (QK) gemm(G, round_up(n_keys, kDotCols), L.d_k, Qi + g0 * L.d_k, L.d_k, KTj, L.Bc_pad, S, L.Bc_pad, false);
      const int64_t k_keys = round_up(n_keys, kDotK);
      for (int64_t r = 0; r < G; ++r) visible[r] = n_keys;
      if (SM) {
        online_softmax(S, L.Bc_pad, G, n_keys, visible, p.scale, m + g0, l + g0, alpha, m_new,
                       PToBf16{Pb, L.Bc_pad, k_keys});
        float* Og = Oi + g0 * L.d_n;
        for (int64_t r = 0; r < G; ++r) scale_row(alpha[r], Og + r * L.d_n, L.d_n);
      }
      if (PV) pv_gemm(G, L.d_n, k_keys, Pb, L.Bc_pad, Vj, L.d_n, Oi + g0 * L.d_n, L.d_n, true);
    }
  }
  if (SM) finish_rows<c10::BFloat16>(p, 0, 0, i0, rows, Oi, L.d_n, m, l);
}


// The products alone (the kernel's shapes: M = a group of 64 query rows, QK: N = Bc keys, K = d; PV: N = d,
// K = Bc), each variant of gemm_variant, and the softmax pieces alone.
struct Variant {
  const char* name;
  Gemm gemm;
};
static const Variant kVariants[] = {
    {"m-outer (bf16_gemm)", bf16_gemm},
    {"n-outer", gemm_variant<true, 0, false>},
    {"m-outer prefetch", gemm_variant<false, 0, true>},
    {"n-outer prefetch", gemm_variant<true, 0, true>},
    {"m-outer k-chunk 64", gemm_variant<false, 64, false>},
    {"m-outer k-chunk 128", gemm_variant<false, 128, false>},
    {"n-outer k-chunk 128", gemm_variant<true, 128, false>},
    {"n-outer k-chunk 128 pf", gemm_variant<true, 128, true>},
};

void micro_kernels() {
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  const DotScope tiles;
  for (int64_t d : {64, 128}) {
    for (int64_t Bc : {256, 512}) {
      const int64_t M = 64;
      std::vector<bf16_bits> A(M * std::max(d, Bc)), B(d * Bc), V(Bc * d);
      for (auto* v : {&A, &B, &V})
        for (auto& x : *v) x = c10::BFloat16(normal(rng) * 0.3f).x;
      std::vector<float> S(M * Bc), O(M * d, 0.f);
      // Every variant computes what bf16_gemm computes (products of the same bf16 in float32: equal up to the
      // order of the K sums; printed as the largest difference).
      std::vector<float> S_ref(M * Bc), O_ref(M * d, 0.f), O_got(M * d);
      bf16_gemm(M, Bc, d, A.data(), d, B.data(), Bc, S_ref.data(), Bc, false);
      bf16_gemm(M, d, Bc, A.data(), Bc, V.data(), d, O_ref.data(), d, false);
      for (const Variant& v : kVariants) {
        v.gemm(M, Bc, d, A.data(), d, B.data(), Bc, S.data(), Bc, false);
        v.gemm(M, d, Bc, A.data(), Bc, V.data(), d, O_got.data(), d, false);
        float diff = 0;
        for (size_t i = 0; i < S.size(); ++i) diff = std::max(diff, std::abs(S[i] - S_ref[i]));
        for (size_t i = 0; i < O_got.size(); ++i) diff = std::max(diff, std::abs(O_got[i] - O_ref[i]));
        if (diff > 1e-3f) std::printf("d=%3ld Bc=%3ld %-24s WRONG: differs from bf16_gemm by %g\n", d, Bc, v.name, diff);
      }
      for (const Variant& v : kVariants) {
        const double qk = seconds_per_call([&] { v.gemm(M, Bc, d, A.data(), d, B.data(), Bc, S.data(), Bc, false); }, 0.05);
        const double pv = seconds_per_call([&] { v.gemm(M, d, Bc, A.data(), Bc, V.data(), d, O.data(), d, true); }, 0.05);
        const double flops = 2.0 * M * Bc * d;
        std::printf("d=%3ld Bc=%3ld %-24s QK %5.0f GFLOP/s   PV %5.0f GFLOP/s\n", d, Bc, v.name, flops / qk / 1e9,
                    flops / pv / 1e9);
      }
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
  // The kernel's query tiles (packing excluded), one head, one thread, with bf16_gemm.h's 2 × 2 blocks and
  // with the column blocks, measured in alternation (best of 3 rounds each: the host is shared).
  for (int64_t d : {64, 128}) {
    for (int64_t N : {1024, 4096}) {
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
      for (int64_t Bc : {256, 512}) {
        const int64_t Br = 128;
        p.block_q = Br; p.block_k = Bc;
        const Layout L(p);
        std::vector<float> ws(workspace_floats(p) + 64);
        run(p, ws.data());  // packs K, V into ws
        const bf16_bits* kt_all = reinterpret_cast<bf16_bits*>(ws.data());
        const bf16_bits* v_all = reinterpret_cast<bf16_bits*>(ws.data() + L.kt_floats);
        float* scratch = ws.data() + L.kt_floats + L.v_floats + L.flags_floats;
        const DotScope tiles;
        using TileFn = std::function<void(int64_t)>;
        const std::pair<const char*, TileFn> combos[] = {
            {"QK m-outer  / PV m-outer (now)", [&](int64_t i0) { query_tile_phases<true, true, true>(p, L, i0, kt_all, v_all, scratch); }},
            {"QK n-outer  / PV m-outer", [&](int64_t i0) { query_tile_phases<true, true, true, gemm_variant<true, 0, false>, bf16_gemm>(p, L, i0, kt_all, v_all, scratch); }},
            {"QK n-outer  / PV k-chunk 128", [&](int64_t i0) { query_tile_phases<true, true, true, gemm_variant<true, 0, false>, gemm_variant<false, 128, false>>(p, L, i0, kt_all, v_all, scratch); }},
            {"QK n-outer  / PV n-outer k-chunk 128", [&](int64_t i0) { query_tile_phases<true, true, true, gemm_variant<true, 0, false>, gemm_variant<true, 128, false>>(p, L, i0, kt_all, v_all, scratch); }},
            {"QK n-out pf / PV m-outer pf", [&](int64_t i0) { query_tile_phases<true, true, true, gemm_variant<true, 0, true>, gemm_variant<false, 0, true>>(p, L, i0, kt_all, v_all, scratch); }},
            {"QK n-out pf / PV k-chunk 64", [&](int64_t i0) { query_tile_phases<true, true, true, gemm_variant<true, 0, true>, gemm_variant<false, 64, false>>(p, L, i0, kt_all, v_all, scratch); }},
            {"QK only (now)", [&](int64_t i0) { query_tile_phases<true, false, false>(p, L, i0, kt_all, v_all, scratch); }},
            {"QK only n-outer", [&](int64_t i0) { query_tile_phases<true, false, false, gemm_variant<true, 0, false>>(p, L, i0, kt_all, v_all, scratch); }},
            {"softmax only", [&](int64_t i0) { query_tile_phases<false, true, false>(p, L, i0, kt_all, v_all, scratch); }},
            {"PV only (now)", [&](int64_t i0) { query_tile_phases<false, false, true>(p, L, i0, kt_all, v_all, scratch); }},
            {"PV only k-chunk 128", [&](int64_t i0) { query_tile_phases<false, false, true, bf16_gemm, gemm_variant<false, 128, false>>(p, L, i0, kt_all, v_all, scratch); }},
            {"PV only n-outer k-chunk 128", [&](int64_t i0) { query_tile_phases<false, false, true, bf16_gemm, gemm_variant<true, 128, false>>(p, L, i0, kt_all, v_all, scratch); }},
        };
        constexpr int kCombos = sizeof(combos) / sizeof(combos[0]);
        double best[kCombos];
        std::fill(best, best + kCombos, 1e30);
        for (int round = 0; round < 3; ++round)  // in alternation, best of 3: the host is shared
          for (int c = 0; c < kCombos; ++c)
            best[c] = std::min(best[c], seconds_per_call([&] {
              for (int64_t i0 = 0; i0 < N; i0 += L.Br) combos[c].second(i0);
            }, 0.04));
        for (int c = 0; c < kCombos; ++c)
          std::printf("d=%3ld N=%4ld Br=%3ld Bc=%3ld  %-38s %5.0f GFLOP/s  %.3f ns per score\n", d, N, Br, Bc,
                      combos[c].first, flops / best[c] / 1e9, best[c] * 1e9 / (double(N) * N));
      }
    }
  }
  return 0;
}
