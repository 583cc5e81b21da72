// Rung 4 — FlashAttention forward (Dao et al., 2022, Algorithm 1), with the online softmax.
//
// Split Q into Tr tiles of Br query rows and K, V into Tc tiles of Bc key rows. For each query tile Q_i:
//   m = −inf, l = 0, O_i = 0                       running row max, running row sum, unnormalised output
//   for each key tile j that the causal mask lets Q_i see:
//     S_ij  = scale · Q_i K_jᵀ                     Br × Bc   (−inf where masked)
//     m_new = max(m, rowmax(S_ij))
//     P_ij  = exp(S_ij − m_new)                    Br × Bc
//     l     = exp(m − m_new) · l + rowsum(P_ij)
//     O_i   = exp(m − m_new) · O_i + P_ij V_j
//     m     = m_new
//   O_i = O_i / l
// Every exponent is ≤ 0, so nothing overflows, and rescaling by exp(m − m_new) keeps the result exact.
// Scratch per thread is S_ij, O_i, m and l: O(Br·(Bc + d)), never N×N.
// A query row that sees no key at all (bottom-right causal with q_len > kv_len) gets O = 0.
#include "../attention.h"
#include "simd.h"

#include <algorithm>
#include <omp.h>
#include <vector>

namespace cs149gpt {
namespace CS149_ISA {
namespace {

// Per-thread scratch for one query tile.
struct FlashScratch {
  float* S;  // Br × Bc scores, then probabilities
  float* O;  // Br × d unnormalised output
  float* m;  // Br running maxima
  float* l;  // Br running sums
};

// S_ij = scale · Q_i K_jᵀ for rows [i0, i0 + rows) and keys [j0, j0 + cols); masked entries −inf.
void tile_scores(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
                 int64_t cols, float* S, int64_t ldS) {
  const float* K = k_head(p, b, h) + j0 * p.k_strides[2];
  const int64_t ks = p.k_strides[2];
  for (int64_t r = 0; r < rows; ++r) {
    const float* q = q_head(p, b, h) + (i0 + r) * p.q_strides[2];
    const int64_t visible = visible_keys(p, i0 + r) - j0;  // keys of this tile the row may see
    float* s = S + r * ldS;
    for (int64_t c = 0; c < cols; ++c) s[c] = c < visible ? p.scale * dot(q, K + c * ks, p.head_dim) : kNegInf;
  }
}

// The online-softmax step for one tile of scores: turns S_ij into P_ij, rescales O_i and l, adds P_ij V_j.
void online_softmax_update(const AttentionParams& p, int64_t b, int64_t h, int64_t rows, int64_t j0,
                           int64_t cols, float* S, int64_t ldS, const FlashScratch& t) {
  const int64_t d = p.head_dim, vs = p.v_strides[2];
  const float* V = v_head(p, b, h) + j0 * vs;
  for (int64_t r = 0; r < rows; ++r) {
    float* s = S + r * ldS;
    float* o = t.O + r * d;
    const float m_new = std::max(t.m[r], max_of(s, cols));
    if (m_new == kNegInf) continue;  // this row sees no key yet: nothing to add
    const float alpha = std::exp(t.m[r] - m_new);  // exp(−inf) = 0 on the first visible tile
    const float row_sum = exp_shifted_sum(s, m_new, cols);
    t.l[r] = alpha * t.l[r] + row_sum;
    t.m[r] = m_new;
    scale_row(alpha, o, d);
    for (int64_t c = 0; c < cols; ++c) axpy(s[c], V + c * vs, o, d);
  }
}

}  // namespace

void flash_attention(const AttentionParams& p) {
  const int64_t Br = p.block_q, Bc = p.block_k, d = p.head_dim;
  const int64_t Tr = (p.q_len + Br - 1) / Br;
  const int64_t n_tasks = p.batch * p.num_heads * Tr;

  // Scratch for every thread, allocated before the parallel region and padded to whole cache lines.
  const int n_threads = omp_get_max_threads();
  auto pad = [](int64_t n) { return (n + 15) / 16 * 16; };
  const int64_t per_thread = pad(Br * Bc) + pad(Br * d) + 2 * pad(Br);
  std::vector<float> scratch(static_cast<size_t>(n_threads) * per_thread);

#pragma omp parallel num_threads(n_threads)
  {
    float* base = scratch.data() + omp_get_thread_num() * per_thread;
    FlashScratch t{base, base + pad(Br * Bc), base + pad(Br * Bc) + pad(Br * d),
                   base + pad(Br * Bc) + pad(Br * d) + pad(Br)};

    // Causal tiles differ in cost (later query tiles see more keys): hand them out dynamically.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_tasks; ++task) {
      const int64_t i = task % Tr, h = (task / Tr) % p.num_heads, b = task / (Tr * p.num_heads);
      const int64_t i0 = i * Br, rows = std::min(Br, p.q_len - i0);

      fill_row(0.0f, t.O, rows * d);
      fill_row(kNegInf, t.m, rows);
      fill_row(0.0f, t.l, rows);

      // Key tiles past the last key that the tile's last row sees are skipped entirely.
      const int64_t keys_seen = visible_keys(p, i0 + rows - 1);
      for (int64_t j0 = 0; j0 < keys_seen; j0 += Bc) {
        const int64_t cols = std::min(Bc, p.kv_len - j0);
        tile_scores(p, b, h, i0, rows, j0, cols, t.S, Bc);
        online_softmax_update(p, b, h, rows, j0, cols, t.S, Bc, t);
      }

      // O_i = O_i / l   (l = 0 only for rows that saw no key: their output is 0)
      for (int64_t r = 0; r < rows; ++r) {
        float* out = out_head(p, b, h) + (i0 + r) * p.out_strides[2];
        const float inv_l = t.l[r] > 0.0f ? 1.0f / t.l[r] : 0.0f;
        for (int64_t c = 0; c < d; ++c) out[c] = t.O[r * d + c] * inv_l;
      }
    }
  }
}

}  // namespace CS149_ISA
}  // namespace cs149gpt
