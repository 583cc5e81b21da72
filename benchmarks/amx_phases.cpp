// Where the bf16 flash forward's time goes on one core (AMX or vdpbf16ps): the real kernel (flash_bf16.cpp)
// timed whole, then with phases left out, and its micro-kernels alone on cache-resident data.
// A measuring tool for issue 9, not part of the extension. Build and run (needs torch's headers for c10):
//   g++ -O3 -fopenmp -I$(python3 -c 'import torch.utils.cpp_extension as c; print(c.include_paths()[0])') \
//       benchmarks/amx_phases.cpp -o /tmp/amx_phases && /tmp/amx_phases [amx|dot]
#include <algorithm>
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
#include "phase_timing.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,avx2,fma,bmi2,f16c")
#define CS149_ISA amx
#define CS149_ISA_AVX512
#define CS149_ISA_BF16_DOT
#define CS149_ISA_AMX
#include "../csrc/kernels/flash_bf16.cpp"

using namespace cs149gpt;
using namespace cs149gpt::amx;
using namespace cs149gpt::amx::flash_bf16;


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


// ---------------------------------------------------------------------------------------------------
// Software pipelining (issue 9, "overlap softmax and products"). The tile unit runs a tdpbf16ps for ~16 cycles
// on its own while the vector units are free, but the kernel's phases come one after another: the products of a
// group wait for its softmax and the softmax for the products. Here the steps s = (key tile j, group g) overlap:
// while the softmax of step s runs a few rows at a time, the products of other steps are issued between the row
// chunks — S of step s + 1 (QK) and O += P V of step s − 1 (PV, P kept in a second buffer) — as work items of one
// 2 × 2 block of C tiles each, so the out-of-order core has tile work in its window all along.
// ---------------------------------------------------------------------------------------------------
struct AmxItem {
  const bf16_bits *A, *B;
  float* C;
  int64_t K, lda, ldb, ldc;
  int nb;
  bool accumulate;
  void run() const {
    if (nb == 2)
      amx_block<2>(K, A, lda, B, ldb, C, ldc, accumulate);
    else
      amx_block<1>(K, A, lda, B, ldb, C, ldc, accumulate);
  }
};
struct AmxQueue {
  AmxItem items[128];
  int n = 0, next = 0;
  void add_gemm(int64_t M, int64_t N, int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B, int64_t ldb,
                float* C, int64_t ldc, bool accumulate) {
    for (int64_t m = 0; m < M; m += 32)
      for (int64_t c = 0; c < N; c += 32)
        items[n++] = AmxItem{A + m * lda, B + b_tile_offset(0, c, ldb), C + m * ldc + c, K, lda, ldb, ldc,
                             N - c >= 32 ? 2 : 1, accumulate};
  }
  void run(int count) {
    for (int i = 0; i < count && next < n; ++i) items[next++].run();
  }
  void drain() {
    run(n);
    n = next = 0;
  }
};

template <int kChunkRows, bool kInterleave>
void query_tile_pipelined(const AttentionParams& p, const Layout& L, int64_t i0, const bf16_bits* kt_all,
                          const bf16_bits* v_all, float* scratch, float* S2, bf16_bits* P2) {
  const int64_t d = p.head_dim, rows = std::min(L.Br, p.q_len - i0), groups = (rows + G - 1) / G;
  bf16_bits* Qi = reinterpret_cast<bf16_bits*>(scratch + L.q_off);
  float* S_buf[2] = {scratch + L.s_off, S2};
  bf16_bits* P_buf[2] = {reinterpret_cast<bf16_bits*>(scratch + L.p_off), P2};
  float *Oi = scratch + L.o_off, *m = scratch + L.m_off, *l = scratch + L.l_off;
  float *alpha = scratch + L.alpha_off, *m_new = alpha + G;
  int64_t visible[G];
  const bf16_bits* Q = reinterpret_cast<const bf16_bits*>(p.q) + i0 * p.q_strides[2];
  std::fill(Qi, Qi + groups * G * L.d_k, bf16_bits{0});
  for (int64_t r = 0; r < rows; ++r) std::copy(Q + r * p.q_strides[2], Q + r * p.q_strides[2] + d, Qi + r * L.d_k);
  fill_row(kNegInf, m, groups * G);
  fill_row(0.0f, l, groups * G);
  fill_row(0.0f, Oi, groups * G * L.d_n);
  const int64_t steps = L.Tc * groups;
  auto cols_of = [&](int64_t s) { return std::min(L.Bc, p.kv_len - (s / groups) * L.Bc); };
  AmxQueue queue;
  auto issue_qk = [&](int64_t s) {
    const int64_t j = s / groups, g0 = (s % groups) * G;
    queue.add_gemm(G, round_up(cols_of(s), kDotCols), L.d_k, Qi + g0 * L.d_k, L.d_k, kt_all + j * L.kt_tile,
                   L.Bc_pad, S_buf[s & 1], L.Bc_pad, false);
  };
  auto issue_pv = [&](int64_t s) {
    const int64_t j = s / groups, g0 = (s % groups) * G;
    queue.add_gemm(G, L.d_n, round_up(cols_of(s), kDotK), P_buf[s & 1], L.Bc_pad, v_all + j * L.v_tile, L.d_n,
                   Oi + g0 * L.d_n, L.d_n, true);
  };
  issue_qk(0);
  queue.drain();
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t g0 = (s % groups) * G, n_keys = cols_of(s), k_keys = round_up(n_keys, kDotK);
    if (s > 0) issue_pv(s - 1);
    if (s + 1 < steps) issue_qk(s + 1);
    if (!kInterleave) queue.drain();
    for (int64_t r = 0; r < G; ++r) visible[r] = n_keys;
    const int chunks = G / kChunkRows, per_chunk = (queue.n + chunks - 1) / chunks;
    for (int64_t r0 = 0; r0 < G; r0 += kChunkRows) {
      online_softmax(S_buf[s & 1] + r0 * L.Bc_pad, L.Bc_pad, kChunkRows, n_keys, visible + r0, p.scale, m + g0 + r0,
                     l + g0 + r0, alpha + r0, m_new + r0, PToBf16{P_buf[s & 1] + r0 * L.Bc_pad, L.Bc_pad, k_keys});
      queue.run(per_chunk);
    }
    queue.drain();
    float* Og = Oi + g0 * L.d_n;
    for (int64_t r = 0; r < G; ++r) scale_row(alpha[r], Og + r * L.d_n, L.d_n);
  }
  issue_pv(steps - 1);
  queue.drain();
  finish_rows<c10::BFloat16>(p, 0, 0, i0, rows, Oi, L.d_n, m, l);
}

// ---------------------------------------------------------------------------------------------------
// S in L1: Q_g K_jᵀ a strip of kStrip keys at a time into a compact G × kStrip buffer (16 KB at 64 × 64; the
// whole-tile S is 64 KB at 64 × 256 and its tile stores go to L2, cost_structure), each strip's softmax read
// from L1 right after. P is taken against a reference max raised lazily: only when a strip's max passes it by
// more than kSlack (natural-log units; P ≤ e^kSlack, well inside bf16's range), and then the pending P columns
// are multiplied into O first (flush) so that no P is ever rescaled after rounding. l sums P as rounded to bf16,
// so a row whose weight sits on one key still gives that key's V exactly (the reference need not be the max).
// ---------------------------------------------------------------------------------------------------
inline float exp_shifted_sum_to_bf16_rounded(const float* x, float shift, int64_t n, float scale, bf16_bits* y,
                                             int64_t n_pad) {
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512 a = _mm512_set1_ps(scale * kLog2e), s = _mm512_set1_ps(-shift * kLog2e);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    const __m512 e0 = exp2_poly<4>(_mm512_fmadd_ps(_mm512_loadu_ps(x + c), a, s));
    const __m512 e1 = exp2_poly<4>(_mm512_fmadd_ps(_mm512_loadu_ps(x + c + 16), a, s));
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
    _mm512_storeu_si512(y + c, packed);
    // the rounded values back: even bf16 lanes are e0's... (cvtne2ps puts e0 in the low 16 lanes)
    sum0 = _mm512_add_ps(sum0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(packed)), 16)));
    sum1 = _mm512_add_ps(sum1, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(packed, 1)), 16)));
  }
  for (; c < n; c += 16) {
    const __mmask16 lanes = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1u);
    const __m512 u = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, x + c), a, s);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(lanes, exp2_poly<4>(u)));
    sum0 = _mm512_add_ps(sum0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    _mm256_mask_storeu_epi16(y + c, lanes, h);
  }
  for (c = n; c < n_pad; ++c) y[c] = 0;
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

template <int64_t kStrip>
void query_tile_strips(const AttentionParams& p, const Layout& L, int64_t i0, const bf16_bits* kt_all,
                       const bf16_bits* v_all, float* scratch, float* S_strip) {
  constexpr float kSlack = 8.0f;
  const int64_t d = p.head_dim, rows = std::min(L.Br, p.q_len - i0), groups = (rows + G - 1) / G;
  bf16_bits* Qi = reinterpret_cast<bf16_bits*>(scratch + L.q_off);
  bf16_bits* Pb = reinterpret_cast<bf16_bits*>(scratch + L.p_off);
  float *Oi = scratch + L.o_off, *m = scratch + L.m_off, *l = scratch + L.l_off;
  const bf16_bits* Q = reinterpret_cast<const bf16_bits*>(p.q) + i0 * p.q_strides[2];
  std::fill(Qi, Qi + groups * G * L.d_k, bf16_bits{0});
  for (int64_t r = 0; r < rows; ++r) std::copy(Q + r * p.q_strides[2], Q + r * p.q_strides[2] + d, Qi + r * L.d_k);
  fill_row(kNegInf, m, groups * G);
  fill_row(0.0f, l, groups * G);
  fill_row(0.0f, Oi, groups * G * L.d_n);
  float strip_max[G];
  for (int64_t j0 = 0, j = 0; j0 < p.kv_len; j0 += L.Bc, ++j) {
    const int64_t n_keys = std::min(L.Bc, p.kv_len - j0), k_keys = round_up(n_keys, kDotK);
    const bf16_bits* KTj = kt_all + j * L.kt_tile;
    const bf16_bits* Vj = v_all + j * L.v_tile;
    for (int64_t g0 = 0; g0 < rows; g0 += G) {
      float *mg = m + g0, *lg = l + g0, *Og = Oi + g0 * L.d_n;
      const bf16_bits* Qg = Qi + g0 * L.d_k;
      int64_t flushed = 0;  // P's columns [0, flushed) are in O already
      for (int64_t c0 = 0; c0 < n_keys; c0 += kStrip) {
        const int64_t sc = std::min(kStrip, n_keys - c0);
        bf16_gemm(G, round_up(sc, kDotCols), L.d_k, Qg, L.d_k, KTj + b_tile_offset(0, c0, L.Bc_pad), L.Bc_pad, S_strip,
                  kStrip, false);
        bool raise = false;
        for (int64_t r = 0; r < G; ++r) {
          strip_max[r] = p.scale * max_of(S_strip + r * kStrip, sc);
          raise |= strip_max[r] > mg[r] + kSlack;
        }
        if (raise) {
          if (c0 > flushed) {
            bf16_gemm(G, L.d_n, c0 - flushed, Pb + flushed, L.Bc_pad, Vj + b_tile_offset(flushed, 0, L.d_n), L.d_n, Og,
                      L.d_n, true);
            flushed = c0;
          }
          for (int64_t r = 0; r < G; ++r)
            if (strip_max[r] > mg[r] + kSlack) {
              const float a = mg[r] == kNegInf ? 0.0f : std::exp(mg[r] - strip_max[r]);
              scale_row(a, Og + r * L.d_n, L.d_n);
              lg[r] *= a;
              mg[r] = strip_max[r];
            }
        }
        const int64_t pad = c0 + sc == n_keys ? k_keys - c0 : sc;
        for (int64_t r = 0; r < G; ++r)
          lg[r] += exp_shifted_sum_to_bf16_rounded(S_strip + r * kStrip, mg[r], sc, p.scale, Pb + r * L.Bc_pad + c0, pad);
      }
      bf16_gemm(G, L.d_n, k_keys - flushed, Pb + flushed, L.Bc_pad, Vj + b_tile_offset(flushed, 0, L.d_n), L.d_n, Og,
                L.d_n, true);
    }
  }
  finish_rows<c10::BFloat16>(p, 0, 0, i0, rows, Oi, L.d_n, m, l);
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

// Where a block's time goes: bf16_gemm's loop with the C blocks (and/or the B tiles) all aliased to one place,
// so that they stay in L1 (the results are wrong; only the time is of interest), against the real layout.
template <bool kAliasC, bool kAliasB, bool kStoreC>
void gemm_aliased(int64_t M, int64_t N, int64_t K, const bf16_bits* A, int64_t lda, const bf16_bits* B, int64_t ldb,
                  float* C, int64_t ldc) {
  for (int64_t m = 0; m < M; m += 32)
    for (int64_t n = 0; n < N; n += 32) {
      float* Cb = kAliasC ? C : C + m * ldc + n;
      const int64_t ldcb = kAliasC ? 32 : ldc;
      const bf16_bits* Bb = kAliasB ? B : B + b_tile_offset(0, n, ldb);
      const bf16_bits* Ab = A + m * lda;
      c_block_begin<2>(Cb, ldcb, false);
      for (int64_t k = 0; k < K; k += kDotK) {
        _tile_loadd(4, Ab + k, lda * 2);
        _tile_loadd(5, Ab + 16 * lda + k, lda * 2);
        products_2xNB<2>(Bb + (kAliasB ? 0 : b_tile_offset(k, 0, ldb)));
      }
      if (kStoreC) c_block_end<2>(Cb, ldcb);
    }
  if (!kStoreC) c_block_end<2>(C, 32);
}

void cost_structure() {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  const DotScope tiles;
  for (int64_t d : {64, 128})
    for (int64_t Bc : {256, 512}) {
      const int64_t M = 64;
      std::vector<bf16_bits> A(M * d), B(d * Bc);
      for (auto* v : {&A, &B})
        for (auto& x : *v) x = c10::BFloat16(normal(rng) * 0.3f).x;
      std::vector<float> S(M * Bc);
      const double flops = 2.0 * M * Bc * d;
      auto t = [&](auto fn) { return flops / seconds_per_call(fn, 0.05) / 1e9; };
      const double real = t([&] { gemm_aliased<false, false, true>(M, Bc, d, A.data(), d, B.data(), Bc, S.data(), Bc); });
      const double c_l1 = t([&] { gemm_aliased<true, false, true>(M, Bc, d, A.data(), d, B.data(), Bc, S.data(), Bc); });
      const double b_l1 = t([&] { gemm_aliased<false, true, true>(M, Bc, d, A.data(), d, B.data(), Bc, S.data(), Bc); });
      const double both = t([&] { gemm_aliased<true, true, true>(M, Bc, d, A.data(), d, B.data(), Bc, S.data(), Bc); });
      const double no_store = t([&] { gemm_aliased<true, true, false>(M, Bc, d, A.data(), d, B.data(), Bc, S.data(), Bc); });
      std::printf("QK d=%3ld Bc=%3ld GFLOP/s: real %4.0f | C in L1 %4.0f | B in L1 %4.0f | both %4.0f | no C stores %4.0f\n",
                  d, Bc, real, c_l1, b_l1, both, no_store);
    }
}

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
  cost_structure();
  if (argc > 1 && std::string(argv[1]) == "cost") return 0;
  if (!(argc > 1 && std::string(argv[1]) == "tiles")) micro_kernels();
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
        run<c10::BFloat16>(p, ws.data());  // packs K, V into ws
        const bf16_bits* kt_all = reinterpret_cast<bf16_bits*>(ws.data());
        const bf16_bits* v_all = reinterpret_cast<bf16_bits*>(ws.data() + L.kt_floats);
        float* scratch = ws.data() + L.kt_floats + L.v_floats + L.flags_floats;
        const DotScope tiles;
        using TileFn = std::function<void(int64_t)>;
        std::vector<float> S2(G * L.Bc_pad + 16), S_strip(G * 128);
        std::vector<bf16_bits> P2(G * L.Bc_pad + 32);
        const std::pair<const char*, TileFn> combos[] = {
            {"QK m-outer  / PV m-outer (now)", [&](int64_t i0) { query_tile_phases<true, true, true>(p, L, i0, kt_all, v_all, scratch); }},
            {"S in L1: 64-key strips", [&](int64_t i0) { query_tile_strips<64>(p, L, i0, kt_all, v_all, scratch, S_strip.data()); }},
            {"S in L1: 128-key strips", [&](int64_t i0) { query_tile_strips<128>(p, L, i0, kt_all, v_all, scratch, S_strip.data()); }},
            {"pipelined, 16-row chunks", [&](int64_t i0) { query_tile_pipelined<16, true>(p, L, i0, kt_all, v_all, scratch, S2.data(), P2.data()); }},
            {"QK only (now)", [&](int64_t i0) { query_tile_phases<true, false, false>(p, L, i0, kt_all, v_all, scratch); }},
            {"softmax only", [&](int64_t i0) { query_tile_phases<false, true, false>(p, L, i0, kt_all, v_all, scratch); }},
            {"PV only (now)", [&](int64_t i0) { query_tile_phases<false, false, true>(p, L, i0, kt_all, v_all, scratch); }},
        };
        // Each variant against a float64 reference over the first 128 query rows (max abs error), and against
        // the kernel's own output (largest difference).
        {
          auto f = [](bf16_bits x) { return double(float(c10::BFloat16(x, c10::BFloat16::from_bits()))); };
          const int64_t ref_rows = 128;
          std::vector<double> o64(ref_rows * d, 0.0);
          for (int64_t i = 0; i < ref_rows; ++i) {
            std::vector<double> w(N);
            double mx = -1e300, sum = 0;
            for (int64_t t = 0; t < N; ++t) {
              double dot = 0;
              for (int64_t c = 0; c < d; ++c) dot += f(q[i * d + c]) * f(k[t * d + c]);
              w[t] = dot * p.scale;
              mx = std::max(mx, w[t]);
            }
            for (int64_t t = 0; t < N; ++t) sum += (w[t] = std::exp(w[t] - mx));
            for (int64_t t = 0; t < N; ++t)
              for (int64_t c = 0; c < d; ++c) o64[i * d + c] += w[t] / sum * f(v[t * d + c]);
          }
          std::vector<bf16_bits> ref;
          for (int c : {0, 1, 2, 3}) {
            for (int64_t i0 = 0; i0 < N; i0 += L.Br) combos[c].second(i0);
            double err = 0;
            for (int64_t i = 0; i < ref_rows * d; ++i) err = std::max(err, std::abs(f(out[i]) - o64[i]));
            float diff = 0;
            if (c == 0) ref = out;
            for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, float(std::abs(f(out[i]) - f(ref[i]))));
            std::printf("d=%3ld N=%4ld Bc=%3ld %-28s error vs float64 %.3g, largest difference from the kernel's %g\n", d,
                        N, Bc, combos[c].first, err, diff);
          }
        }
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
