// Warp-level tile products on mma.sync: C (kMi m16 tiles x kNj n8 tiles, float32 C fragments) += A B over
// kK, the operands in shared memory (or A already in registers). The flash kernels call these by name.
//
// Operand layouts in shared memory (all row-major 2-D tiles with a leading dimension in elements):
//   A (m x k): kATrans = false: A(m, k) at a[m * kLda + k]  (Q, K, V, Pᵀ, dSᵀ as stored)   -> ldmatrix
//              kATrans = true:  A(m, k) at a[k * kLda + m]  (dS read from dSᵀ)              -> ldmatrix.trans
//   B (k x n): kBKMajor = false: B(k, n) at b[n * kLdb + k] (Kᵀ, Qᵀ, dOᵀ: rows of K, Q, dO) -> ldmatrix
//              kBKMajor = true:  B(k, n) at b[k * kLdb + n] (V, dO, Q, K as stored)          -> ldmatrix.trans
// Each ldmatrix_x4 brings one A fragment (16 x 16) or two B fragments (16 k x 16 n); every A fragment feeds
// kNj mma and every B pair 2 kMi, so larger warp tiles read less shared memory per mma.
// Addresses are 32-bit shared-memory offsets: the lane's part is computed once, the tile's part is a constant.
#pragma once

#include "mma.cuh"

namespace cs149gpt {
namespace cuda {

// The lane's element offset for an A fragment load (ldmatrix matrices: rows 0-7 / 8-15 x k 0-7 / 8-15).
template <int kLda, bool kATrans>
__device__ __forceinline__ int a_lane_offset(int lane) {
  return kATrans ? (lane % 8 + (lane / 16) * 8) * kLda + ((lane / 8) % 2) * 8 : (lane % 16) * kLda + (lane / 16) * 8;
}
// The element offset of the A fragment at (m0, k0) from the tile's origin.
template <int kLda, bool kATrans>
__device__ __forceinline__ constexpr int a_tile_offset(int m0, int k0) {
  return kATrans ? k0 * kLda + m0 : m0 * kLda + k0;
}
// The same for a pair of B fragments (n tiles n0 and n0 + 8, k0 .. k0 + 15).
template <int kLdb, bool kBKMajor>
__device__ __forceinline__ int b_lane_offset(int lane) {
  return kBKMajor ? (lane % 8 + ((lane / 8) % 2) * 8) * kLdb + (lane / 16) * 8
                  : (lane % 8 + (lane / 16) * 8) * kLdb + ((lane / 8) % 2) * 8;
}
template <int kLdb, bool kBKMajor>
__device__ __forceinline__ constexpr int b_tile_offset(int n0, int k0) {
  return kBKMajor ? k0 * kLdb + n0 : n0 * kLdb + k0;
}

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4_maybe_trans(uint32_t (&r)[4], uint32_t addr) {
  if (kTrans) ldmatrix_x4_trans(r, addr);
  else ldmatrix_x4(r, addr);
}

// Loads the A fragments of a kMi*16 x kK tile into registers (Q held for a whole forward block).
template <class T, int kMi, int kK, int kLda, bool kATrans = false>
__device__ __forceinline__ void load_a_frags(uint32_t (&frag)[kMi][kK / 16][4], const T* a, int lane) {
  const uint32_t base = smem_addr(a + a_lane_offset<kLda, kATrans>(lane));
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk)
      ldmatrix_x4_maybe_trans<kATrans>(frag[mi][kk],
                                       base + a_tile_offset<kLda, kATrans>(mi * 16, kk * 16) * sizeof(T));
}

// C += A B, A and B in shared memory.
template <class T, int kMi, int kNj, int kK, int kLda, bool kATrans, int kLdb, bool kBKMajor>
__device__ __forceinline__ void warp_gemm_ss(float (&c)[kMi][kNj][4], const T* a, const T* b, int lane) {
  static_assert(kNj % 2 == 0 && kK % 16 == 0, "B fragments come in pairs of n8 tiles, k in steps of 16");
  const uint32_t a_base = smem_addr(a + a_lane_offset<kLda, kATrans>(lane));
  const uint32_t b_base = smem_addr(b + b_lane_offset<kLdb, kBKMajor>(lane));
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t af[kMi][4];
#pragma unroll
    for (int mi = 0; mi < kMi; ++mi)
      ldmatrix_x4_maybe_trans<kATrans>(af[mi], a_base + a_tile_offset<kLda, kATrans>(mi * 16, kk * 16) * sizeof(T));
#pragma unroll
    for (int nn = 0; nn < kNj / 2; ++nn) {
      uint32_t bf[4];
      ldmatrix_x4_maybe_trans<kBKMajor>(bf, b_base + b_tile_offset<kLdb, kBKMajor>(nn * 16, kk * 16) * sizeof(T));
#pragma unroll
      for (int mi = 0; mi < kMi; ++mi) {
        mma_16x8x16<T>(c[mi][2 * nn], af[mi], bf[0], bf[1]);
        mma_16x8x16<T>(c[mi][2 * nn + 1], af[mi], bf[2], bf[3]);
      }
    }
  }
}

// C += A B, A's fragments in registers (Q held, or P straight from the C fragments of S), B in shared memory.
template <class T, int kMi, int kNj, int kK, int kLdb, bool kBKMajor>
__device__ __forceinline__ void warp_gemm_rs(float (&c)[kMi][kNj][4], const uint32_t (&af)[kMi][kK / 16][4],
                                             const T* b, int lane) {
  static_assert(kNj % 2 == 0 && kK % 16 == 0, "B fragments come in pairs of n8 tiles, k in steps of 16");
  const uint32_t b_base = smem_addr(b + b_lane_offset<kLdb, kBKMajor>(lane));
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk)
#pragma unroll
    for (int nn = 0; nn < kNj / 2; ++nn) {
      uint32_t bf[4];
      ldmatrix_x4_maybe_trans<kBKMajor>(bf, b_base + b_tile_offset<kLdb, kBKMajor>(nn * 16, kk * 16) * sizeof(T));
#pragma unroll
      for (int mi = 0; mi < kMi; ++mi) {
        mma_16x8x16<T>(c[mi][2 * nn], af[mi][kk], bf[0], bf[1]);
        mma_16x8x16<T>(c[mi][2 * nn + 1], af[mi][kk], bf[2], bf[3]);
      }
    }
}

// The C fragments of a kMi*16 x kN float tile rounded to T as A fragments (16 x 16 each): C's n8 tiles 2k and
// 2k+1 are A's k tile k, no data moves between lanes.
template <class T, int kMi, int kNj>
__device__ __forceinline__ void c_to_a_frags(uint32_t (&af)[kMi][kNj / 2][4], const float (&c)[kMi][kNj][4]) {
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
    for (int kk = 0; kk < kNj / 2; ++kk) {
      af[mi][kk][0] = pack2<T>(c[mi][2 * kk][0], c[mi][2 * kk][1]);
      af[mi][kk][1] = pack2<T>(c[mi][2 * kk][2], c[mi][2 * kk][3]);
      af[mi][kk][2] = pack2<T>(c[mi][2 * kk + 1][0], c[mi][2 * kk + 1][1]);
      af[mi][kk][3] = pack2<T>(c[mi][2 * kk + 1][2], c[mi][2 * kk + 1][3]);
    }
}

template <int kMi, int kNj>
__device__ __forceinline__ void zero_frags(float (&c)[kMi][kNj][4]) {
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
    for (int n = 0; n < kNj; ++n) c[mi][n][0] = c[mi][n][1] = c[mi][n][2] = c[mi][n][3] = 0.f;
}

}  // namespace cuda
}  // namespace cs149gpt
