// Tile shapes, warpgroups, pipeline depth and shared-memory layout of the Hopper forward, apart from the algorithm.
//
// One block = 3 warpgroups: warpgroup 0 is the producer (one thread issues every TMA copy), warpgroups 1 and 2 the
// consumers, each owning 64 query rows (wgmma's M). Shared memory holds Q once and a ring of kStages (K, V) tiles.
// Every tile is stored as head_dim / 64 panels of (rows x 64 columns): a 128-byte row per panel, the widest box a
// 128-byte swizzled TMA copy takes, and exactly one K-major swizzle atom row for wgmma.
#pragma once

#include <cstdint>

namespace cs149gpt {
namespace cuda {
namespace hopper {

// kOverlap: each consumer warpgroup issues S_{j+1} = Q K_{j+1}ᵀ and O += P_j V_j together and runs the softmax of
// S_{j+1} while P_j V_j is still on the tensor cores (FlashAttention-3's intra-warpgroup overlap); false: S, softmax,
// P V one after another.
// kPingPong (with kOverlap): the two consumer warpgroups take turns to issue their products (two named barriers), so
// that one's softmax runs while the other's products occupy the tensor cores (FlashAttention-3's ping-pong).
// kBlockN: keys per tile (Bc), a multiple of 16 that wgmma_ss has an N for.
template <int kHeadDim_, class T_, bool kOverlap_ = true, bool kPingPong_ = false, int kBlockN_ = 128>
struct FwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kNThreads = 128 * (1 + kConsumerWarpgroups);  // 384
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;           // query rows per block (Br)
  // Bc = 128 at both head dims (default): S (64 x 128) and O (64 x d) float32 fragments, 64 + 64 registers per thread
  // at d 128, fit the consumers' 240 with room for P; 2 stages of K and V then take 128 KB (d 128) of the 227 KB.
  // 176 (FlashAttention-3's Bc for d 128 without a causal mask; wgmma_ss has N = 64, 128, 176) fits too: 208 KB,
  // S 88 + P 44 + O 64 registers, no spill.
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = 2;  // (K, V) tiles in flight: the copy of tile j + 1 runs under the products of tile j
  // setmaxnreg: 128 x 24 + 256 x 240 = 64512 <= 65536 registers of the SM (one block per SM).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr bool kOverlap = kOverlap_;
  static constexpr bool kPingPong = kPingPong_;
  static_assert(!kPingPong || kOverlap, "the ping-pong schedule is that of the overlapped mainloop");

  static constexpr int kPanelCols = 64;  // 64 16-bit values = 128 bytes: one swizzled row
  static constexpr int kPanels = kHeadDim / kPanelCols;
  static constexpr int kRowBytes = 128;
  static constexpr int kQPanelBytes = kBlockM * kRowBytes;
  static constexpr int kKVPanelBytes = kBlockN * kRowBytes;
  static constexpr int kQBytes = kPanels * kQPanelBytes;
  static constexpr int kKVBytes = kPanels * kKVPanelBytes;  // one K (or V) tile
  // Layout (byte offsets from a 1024-byte aligned base): Q | K[kStages] | V[kStages] | mbarriers.
  static constexpr int kSmemQ = 0;
  static constexpr int kSmemK = kSmemQ + kQBytes;
  static constexpr int kSmemV = kSmemK + kStages * kKVBytes;
  static constexpr int kSmemBarriers = kSmemV + kStages * kKVBytes;
  static constexpr int kBarriers = 1 + 4 * kStages;  // Q full; K full, V full, K empty, V empty per stage
  static constexpr int kSmemBytes = kSmemBarriers + 8 * kBarriers + 1024;  // + slack to align the base to 1024

  static_assert(sizeof(T) == 2, "wgmma .bf16 / .f16 operands");
  static_assert(kHeadDim % kPanelCols == 0, "head_dim is a whole number of 64-column panels");
  static_assert(kBlockN % 16 == 0 && kKVPanelBytes % 1024 == 0, "whole k-steps of P V; stages on 1024-byte atoms");
  static_assert(kHeadDim <= 256 && kBlockN <= 256 && kBlockM <= 256, "a TMA box and a wgmma N are at most 256");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one H100 block");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWarpgroups <= 65536, "the SM's registers");
};

// The shipped schedule per head dim (H100, B 4, H 16, N 8192, bf16): ping-pong with Bc 176 at d 128, 711 TFLOP/s full
// and 658 causal (overlap with Bc 128: 680 and 633); ping-pong at d 64, 429 causal (overlap: 359), 405 full (411).
template <int kHeadDim, class T>
using DefaultFwdTraits = FwdTraits<kHeadDim, T, /*kOverlap=*/true, /*kPingPong=*/true, kHeadDim == 128 ? 176 : 128>;

}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
