// Rung 4, readable: FlashAttention's forward on the CPU in float32, plain scalar C++, in the paper's names.
//
// The twin of csrc/cuda/flash_teaching.cu, and the algorithm that flash.cpp runs fast (impl="flash"): read it beside
// the paper first. Q (N_q × d) is cut into Tr = ⌈N_q / Br⌉ row blocks Q_i, K and V (N_k × d) into Tc = ⌈N_k / Bc⌉
// blocks K_j, V_j (the last ones may be short). One task per (batch, head, i) walks the Tc key blocks, keeping for
// each of its Br rows the running max m and sum l of the softmax, and O_i (in `out`):
//   S_ij = scale · Q_i K_jᵀ                          (Br × Bc, in this thread's workspace)
//   m_new = max(m_i, rowmax(S_ij));  P~_ij = exp(S_ij − m_new)
//   l_i = e^{m_i − m_new} l_i + rowsum(P~_ij)
//   O_i = e^{m_i − m_new} O_i + P~_ij V_j;  m_i = m_new
// and at the end O_i = O_i / l_i, lse_i = m_i + log l_i (FlashAttention-2's Algorithm 1: the paper's first version
// divides by l at every step instead, the same value). The N × N scores never exist, one Br × Bc block at a time.
// With is_causal, row r sees key c only if c <= r + causal_offset (0: top-left, N_k − N_q: bottom-right): a row
// reads only the keys it sees (a hidden key's k and v never touch it), a block no row of Q_i sees ends the walk,
// and a row that sees no key at all gets O = 0. Non-finite values follow the README's rule: a NaN or +inf logit makes
// its row NaN, −inf weighs 0. Compiled once (no ISA dispatch, no intrinsics); reads q, k, v in place through their
// strides and allocates nothing.
#include "../attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace cs149gpt {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// This thread's workspace: S_ij (Br × Bc), then m and l (Br each).
int64_t floats_per_thread(const AttentionParams& p) { return p.block_q * p.block_k + 2 * p.block_q; }

// How many keys of the block [first_key, first_key + keys) row `row` sees: a prefix of them.
int64_t keys_seen(const AttentionParams& p, int64_t row, int64_t first_key, int64_t keys) {
  if (!p.is_causal) return keys;
  return std::clamp(row + p.causal_offset + 1 - first_key, int64_t{0}, keys);
}

// rowmax that keeps a NaN (std::max drops one), so that a NaN logit makes its row NaN.
float row_max(float m, const float* s, int64_t n) {
  for (int64_t c = 0; c < n; ++c) m = s[c] > m || std::isnan(s[c]) ? s[c] : m;
  return m;
}

}  // namespace

int64_t flash_teaching_workspace_floats(const AttentionParams& p) { return p.num_threads * floats_per_thread(p); }

void flash_teaching_attention(const AttentionParams& p, float* workspace) {
  const int64_t Br = p.block_q, Bc = p.block_k, d = p.head_dim;
  const int64_t Tr = (p.q_len + Br - 1) / Br, Tc = (p.kv_len + Bc - 1) / Bc;

#pragma omp parallel for collapse(3) schedule(dynamic) num_threads(p.num_threads)
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.num_heads; ++h)
      for (int64_t i = 0; i < Tr; ++i) {
        float* S = workspace + omp_get_thread_num() * floats_per_thread(p);
        float* m = S + Br * Bc;
        float* l = m + Br;
        const float* Q = q_head<float>(p, b, h);
        const float* K = k_head<float>(p, b, h);
        const float* V = v_head<float>(p, b, h);
        float* O = out_head<float>(p, b, h);
        const int64_t first_row = i * Br, rows = std::min(Br, p.q_len - first_row);  // Q_i: rows of Q

        // m_i = −inf, l_i = 0, O_i = 0.
        for (int64_t r = 0; r < rows; ++r) {
          m[r] = kNegInf;
          l[r] = 0.0f;
          std::fill_n(O + (first_row + r) * p.out_strides[2], d, 0.0f);
        }

        for (int64_t j = 0; j < Tc; ++j) {
          const int64_t first_key = j * Bc, keys = std::min(Bc, p.kv_len - first_key);  // K_j, V_j: rows of K, V
          if (keys_seen(p, first_row + rows - 1, first_key, keys) == 0) break;  // causal: no row of Q_i sees K_j

          for (int64_t r = 0; r < rows; ++r) {
            const int64_t seen = keys_seen(p, first_row + r, first_key, keys);
            if (seen == 0) continue;  // this row sees none of K_j: its m, l and O stay as they are
            // S_ij = scale · Q_i K_jᵀ (this row of it)
            const float* q = Q + (first_row + r) * p.q_strides[2];
            float* P = S + r * Bc;
            for (int64_t c = 0; c < seen; ++c) {
              const float* k = K + (first_key + c) * p.k_strides[2];
              float dot = 0.0f;
              for (int64_t x = 0; x < d; ++x) dot += q[x] * k[x];
              P[c] = p.scale * dot;
            }
            // m_new = max(m_i, rowmax(S_ij)); P~_ij = exp(S_ij − m_new), in place. While every logit is −inf
            // (m_new = −inf), P~ = 0: subtract 0 then, not −inf.
            const float m_new = row_max(m[r], P, seen);
            const float shift = m_new == kNegInf ? 0.0f : m_new;
            float rowsum = 0.0f;
            for (int64_t c = 0; c < seen; ++c) {
              P[c] = std::exp(P[c] - shift);
              rowsum += P[c];
            }
            // l_i = e^{m_i − m_new} l_i + rowsum(P~_ij);  O_i = e^{m_i − m_new} O_i + P~_ij V_j, a row of V_j at a time
            const float rescale = std::exp(m[r] - shift);
            l[r] = rescale * l[r] + rowsum;
            float* o = O + (first_row + r) * p.out_strides[2];
            for (int64_t x = 0; x < d; ++x) o[x] *= rescale;
            for (int64_t c = 0; c < seen; ++c) {
              const float* v = V + (first_key + c) * p.v_strides[2];
              for (int64_t x = 0; x < d; ++x) o[x] += P[c] * v[x];
            }
            m[r] = m_new;
          }
        }

        // O_i = O_i / l_i (l_i = 0: every logit was −inf, O_i is 0 already); lse_i = m_i + log l_i
        for (int64_t r = 0; r < rows; ++r) {
          float* o = O + (first_row + r) * p.out_strides[2];
          if (l[r] != 0.0f)
            for (int64_t x = 0; x < d; ++x) o[x] /= l[r];
        }
        if (p.lse != nullptr)  // what a backward starts from (the CUDA twin returns it; the CPU face does not ask)
          for (int64_t r = 0; r < rows; ++r)
            p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + first_row + r] =
                l[r] == 0.0f ? kNegInf : m[r] + std::log(l[r]);
      }
}

}  // namespace cs149gpt
