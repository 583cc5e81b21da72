// Rung 1 — naive attention: materialise the whole score matrix.
//
// For each (batch, head):
//   S = scale · Q Kᵀ        q_len × kv_len, every entry stored
//   P = softmax(S) by rows  in place, masked entries 0
//   O = P V
// Memory is O(q_len · kv_len): the point of this rung is to show that cost.
//
// Compiled once per ISA by csrc/isa/*.cpp (see simd.h); not a translation unit of its own.
#include "../attention.h"
#include "simd.h"

namespace cs149gpt {
namespace CS149_ISA {

int64_t naive_workspace_floats(const AttentionParams& p) { return p.q_len * p.kv_len; }

void naive_attention(const AttentionParams& p, float* S) {
  const int64_t n_q = p.q_len, n_k = p.kv_len, d = p.head_dim;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.num_heads; ++h) {
      const float *Q = q_head<float>(p, b, h), *K = k_head<float>(p, b, h), *V = v_head<float>(p, b, h);
      float* O = out_head<float>(p, b, h);
      const int64_t qs = p.q_strides[2], ks = p.k_strides[2], vs = p.v_strides[2], os = p.out_strides[2];
      // The rows of S are independent: each thread takes whole rows through all three steps.
#pragma omp parallel for schedule(static) num_threads(p.num_threads)
      for (int64_t i = 0; i < n_q; ++i) {
        float* s_row = S + i * n_k;
        const int64_t visible = visible_keys(p, i);

        // S[i, j] = scale · q_i · k_j   (−inf where the causal mask hides key j)
        const float* q = Q + i * qs;
        for (int64_t j = 0; j < visible; ++j) s_row[j] = p.scale * dot(q, K + j * ks, d);
        fill_row(kNegInf, s_row + visible, n_k - visible);

        // P[i, :] = softmax(S[i, :])   (only the visible prefix: exp(−inf) = 0 for the rest)
        softmax_row(s_row, visible);
        fill_row(0.0f, s_row + visible, n_k - visible);

        // O[i, :] = Σ_j P[i, j] · v_j over the visible keys: a hidden key's value row is never read, so a NaN
        // there cannot reach this row through 0 · NaN.
        weighted_row_sum(s_row, V, vs, visible, O + i * os, d);
      }
    }
  }
}

}  // namespace CS149_ISA
}  // namespace cs149gpt
