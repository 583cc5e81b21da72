// Rung 2 — blocked attention: the naive algorithm with both matrix multiplies cache-tiled.
//
// For each (batch, head), with T = the tile size (params.block_q):
//   S = scale · Q Kᵀ   computed T×T tile by tile: a tile of Q rows and a tile of K rows stay in
//                      cache while every pair among them is multiplied, instead of streaming all of K
//                      past every row of Q.
//   P = softmax(S) by rows, in place.
//   O = P V            tile by tile too: a tile of P columns meets the matching tile of V rows.
// Memory is still O(q_len · kv_len); only the order of the arithmetic changes.
#include "../attention.h"
#include "simd.h"

#include <algorithm>

namespace cs149gpt {
namespace CS149_ISA {

int64_t blocked_workspace_floats(const AttentionParams& p) { return p.q_len * p.kv_len; }

void blocked_attention(const AttentionParams& p, float* S) {
  const int64_t n_q = p.q_len, n_k = p.kv_len, d = p.head_dim;
  const int64_t T = p.block_q;
  const int64_t n_row_tiles = (n_q + T - 1) / T;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.num_heads; ++h) {
      const float *Q = q_head<float>(p, b, h), *K = k_head<float>(p, b, h), *V = v_head<float>(p, b, h);
      float* O = out_head<float>(p, b, h);
      const int64_t qs = p.q_strides[2], ks = p.k_strides[2], vs = p.v_strides[2], os = p.out_strides[2];
      // Threads own whole tiles of rows of S (and of O): no two threads write the same line.
#pragma omp parallel for schedule(dynamic, 1) num_threads(p.num_threads)
      for (int64_t it = 0; it < n_row_tiles; ++it) {
        const int64_t i0 = it * T, i1 = std::min(i0 + T, n_q);

        // S[i0:i1, j0:j1] = scale · Q[i0:i1] K[j0:j1]ᵀ, one T×T tile at a time
        for (int64_t j0 = 0; j0 < n_k; j0 += T) {
          const int64_t j1 = std::min(j0 + T, n_k);
          for (int64_t i = i0; i < i1; ++i) {
            const float* q = Q + i * qs;
            const int64_t visible = visible_keys(p, i);
            float* s_row = S + i * n_k;
            for (int64_t j = j0; j < j1; ++j)
              s_row[j] = j < visible ? p.scale * dot(q, K + j * ks, d) : kNegInf;
          }
        }

        // P[i, :] = softmax(S[i, :]); O[i, :] = 0
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t visible = visible_keys(p, i);
          float* s_row = S + i * n_k;
          softmax_row(s_row, visible);
          fill_row(0.0f, s_row + visible, n_k - visible);
          fill_row(0.0f, O + i * os, d);
        }

        // O[i0:i1, c0:c1] += P[i0:i1, j0:j1] V[j0:j1, c0:c1], tiled over keys and head columns
        for (int64_t j0 = 0; j0 < n_k; j0 += T) {
          const int64_t j1 = std::min(j0 + T, n_k);
          for (int64_t c0 = 0; c0 < d; c0 += T) {
            const int64_t width = std::min(T, d - c0);
            for (int64_t i = i0; i < i1; ++i) {
              const float* p_row = S + i * n_k;
              float* o = O + i * os + c0;
              // visible keys only: a hidden key's value row never meets this row (0 · NaN would be NaN)
              const int64_t j_end = std::min(j1, visible_keys(p, i));
              for (int64_t j = j0; j < j_end; ++j) axpy(p_row[j], V + j * vs + c0, o, width);
            }
          }
        }
      }
    }
  }
}

}  // namespace CS149_ISA
}  // namespace cs149gpt
