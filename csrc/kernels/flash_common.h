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

}  // namespace flash
}  // namespace CS149_ISA
}  // namespace cs149gpt
