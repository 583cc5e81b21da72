// Flash-decoding: a few query rows (the tokens being generated) against a long key/value cache.
//
// One query row offers no parallelism across query tiles, and a row group of the tiled kernel would be mostly
// padding, so here the keys are split instead. Split s of S computes for its keys, row by row,
//   m_s = max_j s_j,   l_s = Σ_j exp(s_j − m_s),   O_s = Σ_j exp(s_j − m_s) v_j        (s_j = scale · q·k_j)
// and a merge combines the splits exactly, as the online softmax does tiles:
//   M = max_s m_s,   l = Σ_s exp(m_s − M) l_s,   O = Σ_s exp(m_s − M) O_s / l,   lse = M + log l.
// Work per query row is O(kv_len · d), read once from the cache in place: no packing, no padding.
#include "../attention.h"
#include "simd.h"

#include <algorithm>
#include <omp.h>

namespace cs149gpt {
namespace CS149_ISA {
namespace flash_decode {

constexpr int64_t kMaxRows = 4;             // q_len up to this takes this path
// Keys per split: fixed, not derived from the thread count, so that results are the same for any number of
// threads. 512 keys are a few µs of work, against a merge of one row per split.
constexpr int64_t kKeysPerSplit = 512;

// The flash kernel hands a call to this path when it has this shape, unless the caller fixed the tiles or passed
// an attn_mask, a window or dropout (the tiled kernels take those).
inline bool applies(const AttentionParams& p) {
  return p.q_len <= kMaxRows && p.block_q <= 0 && p.block_k <= 0 && !has_mask_or_window(p) &&
         p.dropout_p == 0.0f;
}

inline int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

struct Layout {
  int64_t splits, split_len, d_pad, part_row, parts_size, per_thread;
  explicit Layout(const AttentionParams& p) {
    const int64_t heads = p.batch * p.num_heads;
    splits = (p.kv_len + kKeysPerSplit - 1) / kKeysPerSplit;
    split_len = kKeysPerSplit;
    d_pad = pad16(p.head_dim);
    part_row = d_pad + 2;  // O_s, then m_s and l_s
    parts_size = heads * splits * p.q_len * part_row;
    per_thread = pad16(split_len) + 2 * d_pad;  // scores of one split; q and k/v rows as float
  }
};

// The row as float32: itself for float, else converted into buf.
template <class T>
inline const float* as_float(const T* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t c = 0; c < n; ++c) buf[c] = static_cast<float>(row[c]);
    return buf;
  }
}

// Split s of head h in batch b: partial (O_s, m_s, l_s) of every query row.
template <class T>
void split_partials(const AttentionParams& p, const Layout& L, int64_t b, int64_t h, int64_t s, float* part,
                    float* scratch) {
  const int64_t d = p.head_dim, j0 = s * L.split_len, j1 = std::min(p.kv_len, j0 + L.split_len);
  float *scores = scratch, *q_buf = scratch + pad16(L.split_len), *kv_buf = q_buf + L.d_pad;
  const T* K = k_head<T>(p, b, h);
  const T* V = v_head<T>(p, b, h);
  for (int64_t i = 0; i < p.q_len; ++i, part += L.part_row) {
    float* O = part;
    const int64_t n = std::clamp<int64_t>(std::min(visible_keys(p, i), j1) - j0, 0, j1 - j0);
    fill_row(0.0f, O, d);
    if (n == 0) {  // none of this split's keys is visible to row i
      O[L.d_pad] = kNegInf;
      O[L.d_pad + 1] = 0.0f;
      continue;
    }
    const float* q = as_float(q_head<T>(p, b, h) + i * p.q_strides[2], q_buf, d);
    for (int64_t t = 0; t < n; ++t)
      scores[t] = p.scale * dot(q, as_float(K + (j0 + t) * p.k_strides[2], kv_buf, d), d);
    // m is NaN if a score is (max_of keeps NaN), and then so are l and O. Scores that are all −inf weigh 0
    // (m = −inf, l = 0), like keys hidden by the mask; their values are still multiplied by that 0, as the
    // tiled kernel does, so a NaN value row shows.
    const float m = max_of(scores, n);
    const float l = m == kNegInf ? (fill_row(0.0f, scores, n), 0.0f) : exp_shifted_sum(scores, m, n);
    for (int64_t t = 0; t < n; ++t) axpy(scores[t], as_float(V + (j0 + t) * p.v_strides[2], kv_buf, d), O, d);
    O[L.d_pad] = m;
    O[L.d_pad + 1] = l;
  }
}

// Row i of head h: merges the splits' partials into out and lse.
template <class T>
void merge_row(const AttentionParams& p, const Layout& L, int64_t b, int64_t h, int64_t i, const float* parts,
               float* O) {
  const int64_t d = p.head_dim;
  const float* first = parts + ((b * p.num_heads + h) * L.splits * p.q_len + i) * L.part_row;
  const int64_t split_stride = p.q_len * L.part_row;
  float M = kNegInf;
  for (int64_t s = 0; s < L.splits; ++s) M = max_nan(M, first[s * split_stride + L.d_pad]);
  T* out = out_head<T>(p, b, h) + i * p.out_strides[2];
  float l = 0.0f;
  fill_row(0.0f, O, d);
  for (int64_t s = 0; s < L.splits; ++s) {
    const float* part = first + s * split_stride;
    // 0 for a split with no weight (m_s = −inf); all 0 when no split has any (M = −inf, where exp(−inf + inf)
    // would be NaN); NaN when M is.
    const float w = M == kNegInf ? 0.0f : std::exp(part[L.d_pad] - M);
    l += w * part[L.d_pad + 1];
    axpy(w, part, O, d);  // even with w = 0: a NaN in O_s (from a NaN value row) must show
  }
  // l = 0: no key had any weight, O = 0 (or NaN, above), lse = −inf. A NaN l stays NaN: never test `l > 0`.
  const float inv_l = l == 0.0f ? 0.0f : 1.0f / l;
  for (int64_t c = 0; c < d; ++c) out[c] = static_cast<T>(O[c] * inv_l);
  if (p.lse) p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i] = l == 0.0f ? kNegInf : M + std::log(l);
}

template <class T>
void run(const AttentionParams& p, float* workspace) {
  const Layout L(p);
  float* parts = workspace;
  float* thread_scratch = workspace + L.parts_size;
  const int64_t n_splits = p.batch * p.num_heads * L.splits, n_rows = p.batch * p.num_heads * p.q_len;
#pragma omp parallel num_threads(p.num_threads)
  {
    float* scratch = thread_scratch + omp_get_thread_num() * L.per_thread;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_splits; ++t) {
      const int64_t s = t % L.splits, h = (t / L.splits) % p.num_heads, b = t / (L.splits * p.num_heads);
      split_partials<T>(p, L, b, h, s, parts + t * p.q_len * L.part_row, scratch);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n_rows; ++r)
      merge_row<T>(p, L, r / (p.num_heads * p.q_len), (r / p.q_len) % p.num_heads, r % p.q_len, parts, scratch);
  }
}

inline int64_t workspace_floats(const AttentionParams& p) {
  const Layout L(p);
  return L.parts_size + p.num_threads * L.per_thread;
}

}  // namespace flash_decode
}  // namespace CS149_ISA
}  // namespace cs149gpt
