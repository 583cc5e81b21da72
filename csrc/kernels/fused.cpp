// Rung 3 — fused attention: one row of scores at a time.
//
// For each query row i of each (batch, head), independently and in parallel:
//   s_j = scale · q_i · k_j            (a row of kv_len scores, in this thread's scratch)
//   p   = softmax(s)
//   o_i = Σ_j p_j · v_j                (o_i held in registers over all j)
// The N×N matrix never exists: the workspace is one row per thread, O(threads · kv_len).
#include "../attention.h"
#include "simd.h"

#include <omp.h>

namespace cs149gpt {
namespace CS149_ISA {

// One score row per thread, padded to a 64-byte multiple so threads never share a cache line.
inline int64_t fused_row_stride(const AttentionParams& p) { return (p.kv_len + 15) / 16 * 16; }

int64_t fused_workspace_floats(const AttentionParams& p) { return p.num_threads * fused_row_stride(p); }

void fused_attention(const AttentionParams& p, float* workspace) {
  const int64_t n_q = p.q_len, d = p.head_dim;
  const int64_t n_rows = p.batch * p.num_heads * n_q;

#pragma omp parallel num_threads(p.num_threads)
  {
    float* s = workspace + omp_get_thread_num() * fused_row_stride(p);
#pragma omp for schedule(dynamic, 16)
    for (int64_t row = 0; row < n_rows; ++row) {
      const int64_t i = row % n_q, h = (row / n_q) % p.num_heads, b = row / (n_q * p.num_heads);
      const int64_t visible = visible_keys(p, i);
      const float* q = q_head<float>(p, b, h) + i * p.q_strides[2];
      const float* K = k_head<float>(p, b, h);
      const float* V = v_head<float>(p, b, h);
      const int64_t ks = p.k_strides[2], vs = p.v_strides[2];
      float* o = out_head<float>(p, b, h) + i * p.out_strides[2];

      for (int64_t j = 0; j < visible; ++j) s[j] = p.scale * dot(q, K + j * ks, d);
      softmax_row(s, visible);
      weighted_row_sum(s, V, vs, visible, o, d);
    }
  }
}

}  // namespace CS149_ISA
}  // namespace cs149gpt
