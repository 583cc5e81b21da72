// Tile shapes, warps and shared-memory layouts of the tensor-core flash kernels, apart from the algorithm.
//
// Forward: every warp owns kMi x 16 query rows of the block_q x head_dim output. Backward: each of the five
// products has its own grid of warp tiles (BwdTraits). The warp-level products themselves: warp_gemm.cuh.
// Shared-memory tiles are row-major with each row padded by 8 elements (16 bytes): the 8 rows an ldmatrix
// reads then start in 8 different 16-byte bank groups, so it is conflict-free without a swizzle.
#pragma once

#include <cstdint>

namespace cs149gpt {
namespace cuda {

// A rows x head_dim tile in shared memory, padded.
template <int kRows_, int kCols_, class T>
struct SmemTile {
  static constexpr int kRows = kRows_, kCols = kCols_;
  static constexpr int kStride = kCols + 8;  // elements between rows
  static constexpr int kElems = kRows * kStride;
  static constexpr int kBytes = kElems * static_cast<int>(sizeof(T));
};

// Forward: a block computes block_q = 16 * kMi * warps query rows of one (batch, head), looping over key tiles
// of block_k rows, K and V double-buffered (the next tile is copied while this one is multiplied). Each warp
// owns kMi m16 row tiles: with 2, every K and V fragment it loads from shared memory feeds two mma.
// kQInRegs: Q's fragments are loaded once into registers; else re-read from shared memory for every tile
// (fewer registers, for kMi = 2 at d = 128).
template <int kHeadDim_, int kNWarps_, int kBlockN_, class T_, int kMi_ = 1, bool kQInRegs_ = true>
struct FwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr int kMi = kMi_;                     // m16 row tiles per warp
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kBlockM = 16 * kMi * kNWarps;  // query rows per block (Br)
  static constexpr int kBlockN = kBlockN_;            // key rows per tile (Bc)
  using QTile = SmemTile<kBlockM, kHeadDim, T>;
  using KVTile = SmemTile<kBlockN, kHeadDim, T>;
  static constexpr int kSmemBytes = QTile::kBytes + 4 * KVTile::kBytes;  // Q, K[2], V[2]
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0, "mma tiles are 16 wide");
};

// Backward: a block owns block_k = kBlockN keys of one (batch, kv head) and keeps dK, dV for them in registers;
// it loops over every query head of the kv head's group and every query tile of block_q = kBlockM rows that sees
// these keys (Q, dO, lse, D double-buffered). Pᵀ and dSᵀ go through shared memory, so each of the five products
// has its own warp tiling, as FlashAttention-2's (the warp grids below; larger, squarer warp tiles read less
// shared memory per mma). dQ is accumulated in float32 with atomics.
//   Sᵀ, dPᵀ (keys x queries):  kWarpsKeysSdP x (warps / kWarpsKeysSdP)
//   dK, dV  (keys x head_dim): kWarpsKeysKV  x (warps / kWarpsKeysKV)
//   dQ      (queries x head_dim): kWarpsRowsDq x (warps / kWarpsRowsDq)
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kWarpsKeysSdP_, int kWarpsKeysKV_,
          int kWarpsRowsDq_, class T_>
struct BwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr int kBlockM = kBlockM_;  // query rows per step (Br)
  static constexpr int kBlockN = kBlockN_;  // keys per block (Bc)
  static constexpr int kWarpsKeysSdP = kWarpsKeysSdP_, kWarpsKeysKV = kWarpsKeysKV_, kWarpsRowsDq = kWarpsRowsDq_;
  // Warp tiles (rows x columns of the product each warp computes).
  static constexpr int kSdpKeys = kBlockN / kWarpsKeysSdP, kSdpQueries = kBlockM / (kNWarps / kWarpsKeysSdP);
  static constexpr int kKvKeys = kBlockN / kWarpsKeysKV, kKvCols = kHeadDim / (kNWarps / kWarpsKeysKV);
  static constexpr int kDqRows = kBlockM / kWarpsRowsDq, kDqCols = kHeadDim / (kNWarps / kWarpsRowsDq);
  using KVTile = SmemTile<kBlockN, kHeadDim, T>;
  using QTile = SmemTile<kBlockM, kHeadDim, T>;
  using PTile = SmemTile<kBlockN, kBlockM, T>;  // Pᵀ and dSᵀ: (keys, queries)
  static constexpr int kSmemBytes = 2 * KVTile::kBytes + 4 * QTile::kBytes + 2 * PTile::kBytes +
                                    4 * kBlockM * static_cast<int>(sizeof(float));
  // (K, V, Q[2], dO[2], Pᵀ, dSᵀ, lse[2], D[2])
  static_assert(kNWarps % kWarpsKeysSdP == 0 && kNWarps % kWarpsKeysKV == 0 && kNWarps % kWarpsRowsDq == 0,
                "warp grids must use every warp");
  static_assert(kSdpKeys % 16 == 0 && kSdpQueries % 16 == 0 && kKvKeys % 16 == 0 && kKvCols % 16 == 0 &&
                    kDqRows % 16 == 0 && kDqCols % 16 == 0,
                "warp tiles are multiples of 16 x 16");
};

}  // namespace cuda
}  // namespace cs149gpt
