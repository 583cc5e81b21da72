// What the flash forward (flash.cpp) and backward (flash_backward.cpp) share: the register blocking of
// their matrix products, and the loop that tiles a product of row groups into micro_gemm calls.
// Compiled once per ISA, like everything under kernels/ (see simd.h).
#pragma once

#include "../attention.h"
#include "simd.h"

namespace cs149gpt {
namespace CS149_ISA {
namespace flash {

// Register blocking per ISA: kAccumulators vector registers hold the C block of micro_gemm, NV ≤ 3 or 4
// vectors wide and kAccumulators / NV rows tall; every such row count divides kRowGroup, the number of
// query rows the kernels move through QKᵀ → softmax → PV together.
// kQkVecs and kPvVecs are the widths the two kinds of product use where the columns allow: S = Q Kᵀ has
// a short k loop (d), so it takes more rows per B vector; O += P V a long one (the keys).
#if defined(CS149_ISA_AVX512)
constexpr int kAccumulators = 24, kRowGroup = 24, kQkVecs = 2, kPvVecs = 4;
#else
constexpr int kAccumulators = 12, kRowGroup = 12, kQkVecs = 3, kPvVecs = 3;
#endif
constexpr int W = Vec::width;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

template <class T>
inline float to_float(T x) { return static_cast<float>(x); }

// C[:rows, :n_cols] = α · C + A[:rows, :K] · B[:K, :n_cols]   (α = 0 when alpha is null)
// through micro_gemm blocks of kAccumulators / NV rows × NV vectors. rows is a multiple of kRowGroup;
// n_cols a whole number of vectors, taken kVecs at a time, then the remainder. A[r, k] is at
// A + r·a_row + k·a_col (a_row = 1 reads a transposed matrix).
template <int NV>
void gemm_block(int64_t rows, int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb,
                float* C, int64_t ldc, const float* alpha) {
  constexpr int R = kAccumulators / NV;
  for (int64_t r = 0; r < rows; r += R)
    micro_gemm<R, NV>(K, A + r * a_row, a_row, a_col, B, ldb, C + r * ldc, ldc, alpha ? alpha + r : nullptr);
}
template <int kVecs>
void group_gemm(int64_t rows, int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb,
                int64_t n_cols, float* C, int64_t ldc, const float* alpha) {
  constexpr int64_t chunk = kVecs * W;
  int64_t c = 0;
  for (; c + chunk <= n_cols; c += chunk) gemm_block<kVecs>(rows, K, A, a_row, a_col, B + c, ldb, C + c, ldc, alpha);
  switch ((n_cols - c) / W) {
    case 0: break;
    case 1: gemm_block<1>(rows, K, A, a_row, a_col, B + c, ldb, C + c, ldc, alpha); break;
    case 2: gemm_block<2>(rows, K, A, a_row, a_col, B + c, ldb, C + c, ldc, alpha); break;
    case 3: gemm_block<3>(rows, K, A, a_row, a_col, B + c, ldb, C + c, ldc, alpha); break;
  }
}


// One step of the online softmax (the paper's lines 9–11) for a group of G query rows against one key tile
// of n_keys scores per row, S[r·ld + t]; row r sees the first visible[r] of them:
//   S = scale · S (scale ≠ 0), −inf past visible[r];   m_new = max(m, rowmax S);   α = exp(m − m_new);
//   S = P = exp(S − m_new);   l = α · l + rowsum P;   m = m_new.
// A row that sees no key yet (m_new = −inf) keeps P = 0, α = 1. The max keeps a NaN (max_nan, max_of):
// m_new = NaN makes α, P and l NaN, so a NaN logit turns the whole row NaN; so does +inf, through
// exp(inf − inf). alpha and m_new are G floats of scratch; alpha holds α afterwards. P goes where PWriter puts
// it (over S by default).
// Where P = exp(S − m_new) goes: over S itself (the float32 kernels), or elsewhere (flash_bf16.cpp writes it in
// bf16 for the next product). exp_sum writes row r's P and returns its sum; zero writes a row of zeros.
// kBase2: the logits S (and so m) are in base 2, P = 2^(S − m_new) (flash.cpp folds log2 e into Q's scale).
struct PInPlace {
  static constexpr bool kBase2 = false;
  float exp_sum(int64_t, float* s, float shift, int64_t n, float scale) const {
    return exp_shifted_sum(s, shift, n, scale);
  }
  void zero(int64_t, float* s, int64_t n) const { fill_row(0.0f, s, n); }
};
struct PInPlaceBase2 {
  static constexpr bool kBase2 = true;
  float exp_sum(int64_t, float* s, float shift, int64_t n, float scale) const {
    return exp2_shifted_sum(s, shift, n, scale);
  }
  void zero(int64_t, float* s, int64_t n) const { fill_row(0.0f, s, n); }
};

template <class PWriter = PInPlace>
inline void online_softmax(float* S, int64_t ld, int64_t G, int64_t n_keys, const int64_t* visible, float scale,
                           float* m, float* l, float* alpha, float* m_new, const PWriter& P = PWriter()) {
  // A positive scale rides along (max of scale·S = scale · max of S; the exp's argument is one FMA);
  // another is applied to S first.
  const bool scale_in_exp = scale > 0.0f;
  for (int64_t r = 0; r < G; ++r) {
    float* s = S + r * ld;
    if (!scale_in_exp) scale_row(scale, s, visible[r]);
    fill_row(kNegInf, s + visible[r], n_keys - visible[r]);
    m_new[r] = max_nan(m[r], (scale_in_exp ? scale : 1.0f) * max_of(s, n_keys));
    alpha[r] = m_new[r] == kNegInf ? 0.0f : m[r] - m_new[r];  // exponent of α; −inf on a first tile
  }
  if constexpr (PWriter::kBase2)
    exp2_row(alpha, G);
  else
    exp_row(alpha, G);
  for (int64_t r = 0; r < G; ++r) {
    float* s = S + r * ld;
    if (m_new[r] == kNegInf) {
      P.zero(r, s, n_keys);
      continue;
    }
    l[r] = alpha[r] * l[r] + P.exp_sum(r, s, m_new[r], n_keys, scale_in_exp ? scale : 1.0f);
    m[r] = m_new[r];
  }
}

// The end of a query tile: rows [i0, i0 + rows) of head h, O = O_i / l and lse = m + log(l) (m in base 2:
// lse = ln 2 · (m + log2(l))), O_i's rows ldo floats apart. Rows that saw no key (l = 0): O = 0, lse = −inf. A NaN l (a NaN or +inf logit) gives NaN in
// both: hence `l == 0`, never `l > 0`, which would read NaN as "no key".
template <class T>
void finish_rows(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t rows, const float* Oi,
                 int64_t ldo, const float* m, const float* l, bool base2 = false) {
  T* out = out_head<T>(p, b, h) + i0 * p.out_strides[2];
  for (int64_t r = 0; r < rows; ++r) {
    const float inv_l = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
    for (int64_t c = 0; c < p.head_dim; ++c) out[r * p.out_strides[2] + c] = static_cast<T>(Oi[r * ldo + c] * inv_l);
  }
  if (p.lse) {
    float* lse = p.lse + b * p.lse_strides[0] + h * p.lse_strides[1] + i0;
    constexpr float kLn2 = 0.693147180559945309f;
    for (int64_t r = 0; r < rows; ++r)
      lse[r] = l[r] == 0.0f ? kNegInf : base2 ? kLn2 * (m[r] + std::log2(l[r])) : m[r] + std::log(l[r]);
  }
}

}  // namespace flash
}  // namespace CS149_ISA
}  // namespace cs149gpt
