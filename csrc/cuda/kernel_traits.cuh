// Tile shapes, warps and shared-memory layouts of the tensor-core flash kernels, apart from the algorithm.
//
// Every warp owns 16 rows of a tile (one m16 row of mma fragments): in the forward, 16 query rows of the
// block_q x head_dim output; in the backward, 16 key rows of the block_k x head_dim dK and dV.
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

// Backward: a block owns block_k = 16 * warps keys of one (batch, kv head) and keeps dK, dV for them in
// registers; it loops over every query head of the kv head's group and every query tile of block_q rows
// that sees these keys (Q, dO, lse, D double-buffered). dQ is accumulated in float32 with atomics.
template <int kHeadDim_, int kNWarps_, int kBlockM_, class T_>
struct BwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr int kBlockN = 16 * kNWarps;  // keys per block
  static constexpr int kBlockM = kBlockM_;      // query rows per step
  using KVTile = SmemTile<kBlockN, kHeadDim, T>;
  using QTile = SmemTile<kBlockM, kHeadDim, T>;
  using DSTile = SmemTile<kBlockN, kBlockM, T>;  // dSᵀ: (keys, queries)
  // dQ = dS K: each warp takes one 16-row slice of the query tile and a slice of the head dim.
  static constexpr int kWarpsPerQSlice = kNWarps / (kBlockM / 16);
  static constexpr int kDqCols = kHeadDim / kWarpsPerQSlice;
  static constexpr int kSmemBytes = 2 * KVTile::kBytes + 4 * QTile::kBytes + DSTile::kBytes +
                                    4 * kBlockM * static_cast<int>(sizeof(float));
  // (K, V, Q[2], dO[2], dS, lse[2], D[2])
  static_assert(kHeadDim % 32 == 0 && kBlockM % 16 == 0, "mma tiles are 16 wide");
  static_assert(kNWarps % (kBlockM / 16) == 0 && kDqCols % 32 == 0, "dQ slices must tile the head dim");
};

}  // namespace cuda
}  // namespace cs149gpt
