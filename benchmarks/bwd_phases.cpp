// Where the float32 one-pass backward's time goes on one core (AVX-512): the real kernel timed whole, one tile
// pair timed whole, then each of its five products and its elementwise pass alone on the tile pair's own buffers,
// and variants of the products (B in panels, K chunked to stay in L1). A measuring tool for issue 12,
// not part of the extension.
// Caution, from its first runs on the device host (results/s9a_bwd_phases.txt, s9b_variants.txt): q, k and v were
// plain std::vectors there, 16 bytes past a 64-byte boundary (glibc's mmap chunk header), so every vector load of
// their rows crossed two cache lines; the forward ran at 82 GFLOP/s in this tool and 130-137 in bench_attention, and
// chunking P V's keys (1.43x here at d = 128) changed nothing in the real kernel (s9c_ab_f32_pv_chunks.txt). Now
// they are aligned as torch aligns tensors; the third argument puts them `offset` floats past the boundary. Those runs
// also timed dQ += dS K with B prefetched 4 or 8 rows ahead, a copy of micro_gemm that covered only 64 columns (its
// 143-152 % "of the peak" at d = 128); removed.
// Build and run (needs torch's headers for c10):
//   g++ -O3 -fopenmp -I$(python3 -c 'import torch.utils.cpp_extension as c; print(c.include_paths()[0])') \
//       benchmarks/bwd_phases.cpp -o /tmp/bwd_phases && /tmp/bwd_phases [B,H,N,d [rounds [offset]]]
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

#include "../csrc/attention.h"
#include "phase_timing.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi2,f16c")
#define CS149_ISA avx512
#define CS149_ISA_AVX512
#include "../csrc/isa/all_kernels.inc"

using namespace cs149gpt;
using namespace cs149gpt::avx512;
using namespace cs149gpt::avx512::flash;

// float arrays on 64-byte boundaries, as torch allocates tensors (a plain std::vector of 16 MB comes from mmap at 16
// bytes past a page, and then every vector load of a row crosses two cache lines: see main's `offset`).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64)); }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <class U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
using Floats = std::vector<float, Aligned64<float>>;

// The best of three runs: the host is noisy.
static double best_of_three(const std::function<void()>& f, double min_time = 0.3) {
  return seconds_per_call(f, min_time, 3);
}

static double fma_peak() {
  const double flops = fma_probe(1 << 22, 1);
  return flops / best_of_three([] { fma_probe(1 << 22, 1); }) / 1e9;
}

// dQ += dS K with the keys in chunks of kChunk, every row block over one chunk before the next (the chunk of K's
// rows stays in L1; dQ's block is loaded and stored once per chunk).
template <int kChunk>
void dq_chunked(int64_t rows, int64_t keys, const float* dS, int64_t ld_s, const float* K, int64_t ld_k, int64_t d,
                float* dQ, int64_t ld_q, const float* ones) {
  for (int64_t t0 = 0; t0 < keys; t0 += kChunk)
    group_gemm<kPvVecs>(rows, std::min<int64_t>(kChunk, keys - t0), dS + t0, ld_s, 1, K + t0 * ld_k, ld_k, d, dQ,
                        ld_q, ones);
}

// ---------------------------------------------------------------------------------------------------
// Variants, timed interleaved: every round times each variant once (~40 ms of calls), over several rounds; the
// minimum and median of the rounds are reported, so that the host's drift hits all variants alike.
// ---------------------------------------------------------------------------------------------------
struct Variant {
  std::string name;
  std::function<void()> fn;
  double flops;
};
static void run_interleaved(const std::vector<Variant>& variants, int rounds, double peak) {
  std::vector<std::vector<double>> t(variants.size());
  for (auto& v : variants) v.fn();  // warm
  for (int round = 0; round < rounds; ++round)
    for (size_t i = 0; i < variants.size(); ++i) t[i].push_back(timed_run(variants[i].fn, 0.04));
  const double base = *std::min_element(t[0].begin(), t[0].end());
  for (size_t i = 0; i < variants.size(); ++i) {
    std::sort(t[i].begin(), t[i].end());
    const double best = t[i][0], median = t[i][t[i].size() / 2];
    std::printf("  %-52s min %9.3f ms  median %9.3f ms  %6.1f GFLOP/s %3.0f %%  x%.3f of the first\n",
                variants[i].name.c_str(), best * 1e3, median * 1e3, variants[i].flops / best / 1e9,
                100 * variants[i].flops / best / 1e9 / peak, base / best);
  }
}

// C[:rows, :d] += A · B over K, where the K loop is cut into chunks of `chunk` (0: whole) and every row block runs
// over one chunk before the next: the chunk of B's rows (chunk × d floats) is read from L2 once and then from L1 by
// each row block, where a whole-K call per row block streams all of B from L2 each time.
template <int kVecs>
void gemm_k_chunked(int64_t chunk, int64_t rows, int64_t K, const float* A, int64_t a_row, int64_t a_col,
                    const float* B, int64_t ldb, int64_t n_cols, float* C, int64_t ldc, const float* ones) {
  if (chunk <= 0) chunk = K;
  for (int64_t k0 = 0; k0 < K; k0 += chunk)
    group_gemm<kVecs>(rows, std::min(chunk, K - k0), A + k0 * a_col, a_row, a_col, B + k0 * ldb, ldb, n_cols, C, ldc,
                      ones);
}

// The one-pass backward's tile pair (flash_backward_onepass.cpp), non-causal and unmasked only, with its products'
// K loops chunked (dq_chunk: dQ += dS K over the keys; dkv_chunk: dV += Pᵀ dO, dK += dSᵀ Q over the query rows),
// and P and dS computed in one pass (fused) or as the kernel does.
struct PairOptions {
  int64_t dq_chunk = 0, dkv_chunk = 0;
  bool fused = false;
};
void tile_pair_variant(const AttentionBackwardParams& bp, const flash_backward_onepass::Layout& L, int64_t b,
                       int64_t h, int64_t i0, int64_t n_keys, const float* delta, const float* lse, float* dQ,
                       float* scratch, const float* Kj, int64_t k_ld, const PairOptions& o) {
  const AttentionParams& p = bp.fwd;
  const int64_t d = p.head_dim, d_pad = L.d_pad, Bc = L.Bc, Br = L.Br, n_cols = round_up(n_keys, kKeyAlign);
  float *Qi = scratch + L.qi_off, *dOi = scratch + L.doi_off, *P = scratch + L.p_off, *dS = scratch + L.ds_off;
  const float *KTj = scratch + L.kt_off, *VTj = scratch + L.vt_off, *ones = scratch + L.ones_off;
  float *dK = scratch + L.dk_off, *dV = scratch + L.dv_off;
  flash_backward_onepass::pack_rows<float>(p.q, p.q_strides, p, L, b, h, i0, Qi);
  flash_backward_onepass::pack_rows<float>(bp.dout, bp.dout_strides, p, L, b, h, i0, dOi);
  group_gemm<kQkVecs>(Br, d, Qi, d_pad, 1, KTj, Bc, n_cols, P, Bc, nullptr);
  group_gemm<kQkVecs>(Br, d, dOi, d_pad, 1, VTj, Bc, n_cols, dS, Bc, nullptr);
  for (int64_t r = 0; r < Br; ++r) {
    float *pr = P + r * Bc, *dsr = dS + r * Bc;
    const Vec D = Vec::broadcast(delta[i0 + r]);
    if (o.fused) {
      const Vec shift = Vec::broadcast(-lse[i0 + r]), scale = Vec::broadcast(p.scale);
      for (int64_t c = 0; c < n_cols; c += W) {
        const Vec pv = exp(fmadd(Vec::load(pr + c), scale, shift));
        pv.store(pr + c);
        (pv * (Vec::load(dsr + c) - D)).store(dsr + c);
      }
    } else {
      exp_shifted_sum(pr, lse[i0 + r], n_cols, p.scale);
      for (int64_t c = 0; c < n_cols; c += W) (Vec::load(pr + c) * (Vec::load(dsr + c) - D)).store(dsr + c);
    }
    fill_row(0.0f, pr + n_keys, n_cols - n_keys);
    fill_row(0.0f, dsr + n_keys, n_cols - n_keys);
  }
  gemm_k_chunked<kPvVecs>(o.dkv_chunk, n_cols, Br, P, 1, Bc, dOi, d_pad, d_pad, dV, d_pad, ones);
  gemm_k_chunked<kPvVecs>(o.dkv_chunk, n_cols, Br, dS, 1, Bc, Qi, d_pad, d_pad, dK, d_pad, ones);
  gemm_k_chunked<kPvVecs>(o.dq_chunk, Br, n_keys, dS, Bc, 1, Kj, k_ld, d_pad, dQ + i0 * d_pad, d_pad, ones);
}

// The whole backward on one thread, as kv_head_task runs it, over tile_pair_variant.
void backward_variant(const AttentionBackwardParams& bp, float* ws, const PairOptions& o) {
  namespace op = flash_backward_onepass;
  const AttentionParams& p = bp.fwd;
  const op::Layout L(bp);
  float* scratch = ws;
  fill_row(1.0f, scratch + L.ones_off, std::max(L.Br, L.Bc));
  const int64_t d = p.head_dim, d_pad = L.d_pad;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.num_heads; ++h) {
      static Floats dq_rows_buffer;  // the copy keeps its own dQ (the kernel's may live in dq itself)
      dq_rows_buffer.resize(L.q_pad * d_pad);
      float *delta = scratch + L.delta_off, *lse = scratch + L.lse_off, *dQ = dq_rows_buffer.data();
      float *dK = scratch + L.dk_off, *dV = scratch + L.dv_off;
      fill_row(0.0f, dQ, L.q_pad * d_pad);
      op::row_statistics<float>(bp, L, b, h, delta, lse);
      for (int64_t j0 = 0; j0 < p.kv_len; j0 += L.Bc) {
        const int64_t n_keys = std::min(L.Bc, p.kv_len - j0);
        op::pack_key_tile<float>(p, L, b, h, j0, scratch + L.kt_off, scratch + L.vt_off, scratch + L.kr_off);
        fill_row(0.0f, dK, L.Bc * d_pad);
        fill_row(0.0f, dV, L.Bc * d_pad);
        const float* Kj = static_cast<const float*>(p.k) + b * p.k_strides[0] + h * p.k_strides[1] + j0 * p.k_strides[2];
        for (int64_t i0 = 0; i0 < p.q_len; i0 += L.Br)
          tile_pair_variant(bp, L, b, h, i0, n_keys, delta, lse, dQ, scratch, Kj, p.k_strides[2], o);
        float* dk_out = static_cast<float*>(bp.dk) + b * bp.dk_strides[0] + h * bp.dk_strides[1] + j0 * bp.dk_strides[2];
        float* dv_out = static_cast<float*>(bp.dv) + b * bp.dv_strides[0] + h * bp.dv_strides[1] + j0 * bp.dv_strides[2];
        for (int64_t t = 0; t < n_keys; ++t)
          for (int64_t c = 0; c < d; ++c) {
            dk_out[t * bp.dk_strides[2] + c] = p.scale * dK[t * d_pad + c];
            dv_out[t * bp.dv_strides[2] + c] = dV[t * d_pad + c];
          }
      }
      float* dq_out = static_cast<float*>(bp.dq) + b * bp.dq_strides[0] + h * bp.dq_strides[1];
      for (int64_t i = 0; i < p.q_len; ++i)
        for (int64_t c = 0; c < d; ++c) dq_out[i * bp.dq_strides[2] + c] = p.scale * dQ[i * d_pad + c];
    }
}

// The float32 forward's query tile (flash.cpp), non-causal and unmasked only, with P V's K loop (the keys) chunked.
void forward_variant(const AttentionParams& p, float* workspace, int64_t pv_chunk) {
  const flash::Layout L(p);
  float* kt_all = workspace;
  float* thread_scratch = workspace + L.kt_size + L.v_size + L.flags_size;
  for (int64_t t = 0; t < p.batch * p.num_kv_heads * L.Tc; ++t)
    pack_kv_tile<float>(p, L, t / (p.num_kv_heads * L.Tc), (t / L.Tc) % p.num_kv_heads, t % L.Tc, kt_all, nullptr,
                        nullptr);
  float* scratch = thread_scratch;
  const int64_t d = p.head_dim, d_pad = L.d_pad;
  float *Qi = scratch + L.q_off, *S = scratch + L.s_off, *Oi = scratch + L.o_off;
  float *m = scratch + L.m_off, *l = scratch + L.l_off;
  float *alpha = scratch + L.alpha_off, *m_new = alpha + kRowGroup;
  alignas(64) static float ones[kRowGroup];
  for (auto& x : ones) x = 1.0f;
  int64_t visible[kRowGroup];
  constexpr float kLog2e = 1.44269504088896341f;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.num_heads; ++h)
      for (int64_t i0 = 0; i0 < p.q_len; i0 += L.Br) {
        const int64_t rows = std::min(L.Br, p.q_len - i0), groups = (rows + kRowGroup - 1) / kRowGroup;
        const float* Q = q_head<float>(p, b, h) + i0 * p.q_strides[2];
        for (int64_t g0 = 0; g0 < groups * kRowGroup; g0 += kRowGroup)
          transpose_block(Q + g0 * p.q_strides[2], p.q_strides[2], std::min<int64_t>(kRowGroup, rows - g0), d, p.scale * kLog2e, Qi + g0 * d,
                          kRowGroup);
        fill_row(kNegInf, m, groups * kRowGroup);
        fill_row(0.0f, l, groups * kRowGroup);
        fill_row(0.0f, Oi, groups * kRowGroup * d_pad);
        const int64_t head = b * p.num_kv_heads + kv_head(p, h);
        for (int64_t j0 = 0, j = 0; j0 < p.kv_len; j0 += L.Bc, ++j) {
          const int64_t n_keys = std::min(L.Bc, p.kv_len - j0);
          const float* KTj = kt_all + (head * L.Tc + j) * L.kt_tile;
          const float* Vj = static_cast<const float*>(p.v) + b * p.v_strides[0] + kv_head(p, h) * p.v_strides[1] +
                            j0 * p.v_strides[2];
          for (int64_t g0 = 0; g0 < rows; g0 += kRowGroup) {
            group_gemm_panels<kQkVecs, true>(kRowGroup, d, Qi + g0 * d, 1, kRowGroup, KTj, L.panel,
                                             round_up(n_keys, W), S, L.s_ld);
            for (int64_t r = 0; r < kRowGroup; ++r) visible[r] = n_keys;
            online_softmax(S, L.s_ld, kRowGroup, n_keys, visible, 1.0f, m + g0, l + g0, alpha, m_new,
                           PInPlaceBase2{});
            const int64_t chunk = pv_chunk > 0 ? pv_chunk : n_keys;
            for (int64_t k0 = 0; k0 < n_keys; k0 += chunk)
              group_gemm<kPvVecs>(kRowGroup, std::min(chunk, n_keys - k0), S + k0, L.s_ld, 1, Vj + k0 * p.v_strides[2],
                                  p.v_strides[2], d_pad, Oi + g0 * d_pad, d_pad, k0 == 0 ? alpha : ones);
          }
        }
        finish_rows<float>(p, b, h, i0, rows, Oi, d_pad, m, l, true);
      }
}

static double max_diff(const Floats& a, const Floats& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::fabs(a[i] - b[i])));
  return m;
}

int main(int argc, char** argv) {
  int64_t B = 1, H = 12, N = 1024, d = 64;
  if (argc > 1) std::sscanf(argv[1], "%ld,%ld,%ld,%ld", &B, &H, &N, &d);
  std::printf("bwd_phases (%ld,%ld,%ld,%ld) float32, one thread, AVX-512\n", B, H, N, d);
  const double peak = fma_peak();
  std::printf("FMA probe: %.1f GFLOP/s\n", peak);

  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  const int64_t n = B * H * N * d;
  // offset: q, k, v start this many floats past a 64-byte boundary (4: what a plain std::vector of their size got
  // in the runs s9a and s9b, whose rows then crossed cache lines).
  const int64_t offset = argc > 3 ? std::atol(argv[3]) : 0;
  std::printf("q, k, v at %ld floats past a 64-byte boundary\n", offset);
  Floats q_mem(n + offset), k_mem(n + offset), v_mem(n + offset);
  Floats out(n), dout(n), dq(n), dk(n), dv(n), lse(B * H * N);
  for (auto* x : {&q_mem, &k_mem, &v_mem, &dout})
    for (auto& e : *x) e = normal(gen);
  const float *q = q_mem.data() + offset, *k = k_mem.data() + offset, *v = v_mem.data() + offset;

  AttentionBackwardParams bp;
  AttentionParams& p = bp.fwd;
  p.q = q, p.k = k, p.v = v, p.out = out.data(), p.lse = lse.data();
  const int64_t strides[3] = {H * N * d, N * d, d};
  for (int i = 0; i < 3; ++i)
    p.q_strides[i] = p.k_strides[i] = p.v_strides[i] = p.out_strides[i] = bp.dout_strides[i] = bp.dq_strides[i] =
        bp.dk_strides[i] = bp.dv_strides[i] = strides[i];
  p.lse_strides[0] = H * N, p.lse_strides[1] = N;
  p.batch = B, p.num_heads = H, p.num_kv_heads = H, p.q_len = N, p.kv_len = N, p.head_dim = d;
  p.scale = 1.0f / std::sqrt(float(d));
  p.block_q = p.block_k = 0;
  p.num_threads = 1;
  Floats fws(flash_workspace_floats(p) + 64);
  flash_attention(p, fws.data());
  bp.path = BackwardPath::one_pass;
  bp.dout = dout.data(), bp.dq = dq.data(), bp.dk = dk.data(), bp.dv = dv.data();

  const double flops = 10.0 * B * H * N * N * d;
  Floats ws(flash_backward_workspace_floats(bp) + 64);
  const double whole = best_of_three([&] { flash_attention_backward(bp, ws.data()); }, 1.0);
  std::printf("whole backward: %.2f ms, %.1f GFLOP/s (%.0f %% of the probe)\n", whole * 1e3, flops / whole / 1e9,
              100 * flops / whole / 1e9 / peak);

  // One task's setup as kv_head_task does it, then tile pair (i0 = 0, j0 = 0) over and over.
  namespace op = flash_backward_onepass;
  const op::Layout L(bp);
  std::printf("tiles Br %ld x Bc %ld, d_pad %ld, K rows in place %d\n", L.Br, L.Bc, L.d_pad, int(L.k_rows_in_place));
  float* scratch = ws.data();
  fill_row(1.0f, scratch + L.ones_off, std::max(L.Br, L.Bc));
  float* dQ = scratch + L.dq_off;
  fill_row(0.0f, dQ, L.group_size * L.q_pad * L.d_pad);
  op::row_statistics<float>(bp, L, 0, 0, scratch + L.delta_off, scratch + L.lse_off);
  op::pack_key_tile<float>(p, L, 0, 0, 0, scratch + L.kt_off, scratch + L.vt_off, scratch + L.kr_off);
  const double pair_flops = 10.0 * L.Br * L.Bc * d;
  const int64_t pairs = B * H * L.Tr * L.Tc;
  auto report = [&](const char* what, double s, double f) {
    std::printf("  %-44s %8.2f us  %6.1f GFLOP/s  %3.0f %%   (x pairs: %.1f ms)\n", what, s * 1e6, f / s / 1e9,
                100 * f / s / 1e9 / peak, s * pairs * 1e3);
  };
  const double pair = best_of_three([&] {
    op::tile_pair<float>(bp, L, 0, 0, 0, 0, L.Bc, scratch + L.delta_off, scratch + L.lse_off, dQ, scratch);
  });
  report("tile_pair whole", pair, pair_flops);

  float *Qi = scratch + L.qi_off, *dOi = scratch + L.doi_off, *P = scratch + L.p_off, *dS = scratch + L.ds_off;
  const float *KTj = scratch + L.kt_off, *VTj = scratch + L.vt_off, *ones = scratch + L.ones_off;
  const float* Kj = static_cast<const float*>(p.k);
  float *dK = scratch + L.dk_off, *dV = scratch + L.dv_off;
  const int64_t Br = L.Br, Bc = L.Bc, dp = L.d_pad;
  const double prod = 2.0 * Br * Bc * d;
  report("pack Q_i, dO_i", best_of_three([&] {
           op::pack_rows<float>(p.q, p.q_strides, p, L, 0, 0, 0, Qi);
           op::pack_rows<float>(bp.dout, bp.dout_strides, p, L, 0, 0, 0, dOi);
         }), 0);
  report("S = Q K^T  (12x2, B rows Bc apart)", best_of_three([&] {
           group_gemm<kQkVecs>(Br, d, Qi, dp, 1, KTj, Bc, Bc, P, Bc, nullptr);
         }), prod);
  report("dP = dO V^T", best_of_three([&] {
           group_gemm<kQkVecs>(Br, d, dOi, dp, 1, VTj, Bc, Bc, dS, Bc, nullptr);
         }), prod);
  // The same with K^T in 32-key panels (the forward's layout).
  Floats panels(d * Bc);
  for (int64_t c = 0; c < Bc; ++c)
    for (int64_t r = 0; r < d; ++r) panels[(c / 32) * 32 * d + r * 32 + c % 32] = KTj[r * Bc + c];
  report("S = Q K^T, K^T in 32-key panels", best_of_three([&] {
           group_gemm_panels<kQkVecs>(Br, d, Qi, dp, 1, panels.data(), 32, Bc, P, Bc);
         }), prod);
  const float* lse_rows = scratch + L.lse_off;
  const float* delta = scratch + L.delta_off;
  group_gemm<kQkVecs>(Br, d, Qi, dp, 1, KTj, Bc, Bc, P, Bc, nullptr);
  Floats S0(P, P + Br * Bc);
  report("P = exp(scale S - lse), dS = P (dP - D)", best_of_three([&] {
           std::memcpy(P, S0.data(), Br * Bc * 4);
           for (int64_t r = 0; r < Br; ++r) {
             float *pr = P + r * Bc, *dsr = dS + r * Bc;
             exp_shifted_sum(pr, lse_rows[r], Bc, p.scale);
             const Vec D = Vec::broadcast(delta[r]);
             for (int64_t c = 0; c < Bc; c += W) (Vec::load(pr + c) * (Vec::load(dsr + c) - D)).store(dsr + c);
           }
         }), 0);
  report("  (its memcpy of S alone)", best_of_three([&] { std::memcpy(P, S0.data(), Br * Bc * 4); }), 0);
  report("dV += P^T dO  (6x4, A transposed)", best_of_three([&] {
           group_gemm<kPvVecs>(Bc, Br, P, 1, Bc, dOi, dp, dp, dV, dp, ones);
         }), prod);
  report("dV += P^T dO, kRowsAdjacent", best_of_three([&] {
           group_gemm<kPvVecs, true>(Bc, Br, P, 1, Bc, dOi, dp, dp, dV, dp, ones);
         }), prod);
  report("dK += dS^T Q", best_of_three([&] {
           group_gemm<kPvVecs>(Bc, Br, dS, 1, Bc, Qi, dp, dp, dK, dp, ones);
         }), prod);
  report("dQ += dS K  (6x4, B = K rows in place)", best_of_three([&] {
           group_gemm<kPvVecs>(Br, Bc, dS, Bc, 1, Kj, d, dp, dQ, dp, ones);
         }), prod);
  report("dQ += dS K, keys in chunks of 48", best_of_three([&] {
           dq_chunked<48>(Br, Bc, dS, Bc, Kj, d, dp, dQ, dp, ones);
         }), prod);
  report("dQ += dS K, keys in chunks of 96", best_of_three([&] {
           dq_chunked<96>(Br, Bc, dS, Bc, Kj, d, dp, dQ, dp, ones);
         }), prod);
  // The ceilings: the same micro-kernels on operands that stay in L1.
  {
    alignas(64) static float a[64 * 64], b[64 * 64], c[24 * 64];
    for (auto& x : a) x = 0.001f;
    for (auto& x : b) x = 0.001f;
    const int64_t reps = 256;
    report("ceiling: micro_gemm<12,2> K=64, L1", best_of_three([&] {
             for (int64_t i = 0; i < reps; ++i) micro_gemm<12, 2, false>(64, a, 64, 1, b, 32, c, 32, nullptr);
           }), reps * 2.0 * 12 * 32 * 64);
    report("ceiling: micro_gemm<6,4> K=64, L1", best_of_three([&] {
             for (int64_t i = 0; i < reps; ++i) micro_gemm<6, 4, false>(64, a, 64, 1, b, 64, c, 64, c);
           }), reps * 2.0 * 6 * 64 * 64);
    report("ceiling: micro_gemm<6,4> A transposed, L1", best_of_three([&] {
             for (int64_t i = 0; i < reps; ++i) micro_gemm<6, 4, false>(64, a, 1, 64, b, 64, c, 64, c);
           }), reps * 2.0 * 6 * 64 * 64);
  }
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  // Backward variants: first check that the copy computes what the kernel does.
  {
    Floats dq0 = dq, dk0 = dk, dv0 = dv;
    flash_attention_backward(bp, ws.data());
    dq0 = dq, dk0 = dk, dv0 = dv;
    backward_variant(bp, ws.data(), PairOptions{96, 48, true});
    std::printf("backward copy vs kernel: max |diff| dq %.2e dk %.2e dv %.2e\n", max_diff(dq, dq0), max_diff(dk, dk0),
                max_diff(dv, dv0));
  }
  std::vector<Variant> bwd;
  bwd.push_back({"backward kernel (one pass, default tiles)", [&] { flash_attention_backward(bp, ws.data()); }, flops});
  bwd.push_back({"copy: as the kernel", [&] { backward_variant(bp, ws.data(), PairOptions{0, 0, false}); }, flops});
  bwd.push_back({"copy: P, dS fused", [&] { backward_variant(bp, ws.data(), PairOptions{0, 0, true}); }, flops});
  for (int64_t dq_chunk : {48, 64, 96})
    bwd.push_back({"copy: fused, dQ keys chunked " + std::to_string(dq_chunk),
                   [&, dq_chunk] { backward_variant(bp, ws.data(), PairOptions{dq_chunk, 0, true}); }, flops});
  for (int64_t dkv_chunk : {24, 48})
    bwd.push_back({"copy: fused, dQ 64, dK dV rows chunked " + std::to_string(dkv_chunk),
                   [&, dkv_chunk] { backward_variant(bp, ws.data(), PairOptions{64, dkv_chunk, true}); }, flops});
  // Other tiles through the kernel itself (block_q, block_k).
  std::vector<AttentionBackwardParams> tiled;
  for (auto [bq, bk] : std::vector<std::pair<int64_t, int64_t>>{{48, 96}, {48, 192}, {96, 96}, {192, 96}}) {
    AttentionBackwardParams t = bp;
    t.fwd.block_q = bq, t.fwd.block_k = bk;
    tiled.push_back(t);
  }
  std::vector<Floats> tiled_ws;
  for (auto& t : tiled) tiled_ws.emplace_back(flash_backward_workspace_floats(t) + 64);
  for (size_t i = 0; i < tiled.size(); ++i)
    bwd.push_back({"kernel, tiles " + std::to_string(tiled[i].fwd.block_q) + " x " + std::to_string(tiled[i].fwd.block_k),
                   [&, i] { flash_attention_backward(tiled[i], tiled_ws[i].data()); }, flops});
  std::printf("backward variants, %d rounds:\n", rounds);
  run_interleaved(bwd, rounds, peak);

  // Forward variants.
  {
    Floats out0 = out;
    forward_variant(p, fws.data(), 64);
    std::printf("forward copy vs kernel: max |diff| %.2e\n", max_diff(out, out0));
  }
  const double fflops = 4.0 * B * H * N * N * d;
  std::vector<Variant> fwd;
  fwd.push_back({"forward kernel (default tiles)", [&] { flash_attention(p, fws.data()); }, fflops});
  fwd.push_back({"copy: as the kernel", [&] { forward_variant(p, fws.data(), 0); }, fflops});
  for (int64_t c : {32, 64, 128})
    fwd.push_back({"copy: P V keys chunked " + std::to_string(c), [&, c] { forward_variant(p, fws.data(), c); }, fflops});
  std::vector<AttentionParams> ftiled;
  for (int64_t bk : {128, 256}) {
    AttentionParams t = p;
    t.block_k = bk;
    ftiled.push_back(t);
  }
  std::vector<Floats> ftiled_ws;
  for (auto& t : ftiled) ftiled_ws.emplace_back(flash_workspace_floats(t) + 64);
  for (size_t i = 0; i < ftiled.size(); ++i)
    fwd.push_back({"kernel, key tiles " + std::to_string(ftiled[i].block_k),
                   [&, i] { flash_attention(ftiled[i], ftiled_ws[i].data()); }, fflops});
  std::printf("forward variants, %d rounds:\n", rounds);
  run_interleaved(fwd, rounds, peak);
  return 0;
}
