// Tile shapes, warpgroups, pipeline depth and shared-memory layout of the Hopper forward and backward, apart from the
// algorithm.
//
// One block = 1 + kConsumerWarpgroups warpgroups: warpgroup 0 is the producer (one thread issues every TMA copy), the
// others the consumers, each owning 64 query rows (wgmma's M). Shared memory holds a Q tile, a ring of kStages (K, V)
// tiles and, where one fits, a buffer to stage O in.
// Every tile is stored as head_dim / 64 panels of (rows x 64 columns): a 128-byte row per panel, the widest box a
// 128-byte swizzled TMA copy takes, and exactly one K-major swizzle atom row for wgmma.
#pragma once

#include <cstdint>
#include <type_traits>

namespace cs149gpt {
namespace cuda {
namespace hopper {

// The kernels' masking (kMask): none, the causal mask, or key spans (attn_mask's key ranges, windows, causal: the tops
// of flash_fwd_hopper.cuh and flash_bwd_hopper.cuh).
constexpr int kMaskNone = 0, kMaskCausal = 1, kMaskSpans = 2;

// kOverlap: each consumer warpgroup issues S_{j+1} = Q K_{j+1}ᵀ and O += P_j V_j together and runs the softmax of
// S_{j+1} while P_j V_j is still on the tensor cores (FlashAttention-3's intra-warpgroup overlap); false: S, softmax,
// P V one after another.
// kPingPong (with kOverlap): the consumer warpgroups take turns to issue their products (a named barrier each), so
// that one's softmax runs while another's products occupy the tensor cores (FlashAttention-3's ping-pong).
// kBlockN: keys per tile (Bc), a multiple of 16 that wgmma_ss has an N for.
// kConsumerWarpgroups: 2 (Br 128) or 3 (Br 192, FlashAttention-3's tile at d 64; the ping-pong's turn then goes round
// the three).
template <int kHeadDim_, class T_, bool kOverlap_ = true, bool kPingPong_ = false, int kBlockN_ = 128,
          int kConsumerWarpgroups_ = 2>
struct FwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumerWarpgroups = kConsumerWarpgroups_;
  static constexpr int kNThreads = 128 * (1 + kConsumerWarpgroups);  // 384 or 512
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;           // query rows per block (Br)
  // Bc 128: S (64 x 128) and O (64 x d) float32 fragments, 64 + 64 registers per thread at d 128, fit the consumers'
  // 240 with room for P; 2 stages of K and V then take 128 KB (d 128) of the 227 KB. Wider tiles fit at d 128 without
  // a spill: 160 (192 KB, S 80 + P 40 + O 64 registers) and 192 (224 KB, S 96 + P 48).
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = 2;  // (K, V) tiles in flight: the copy of tile j + 1 runs under the products of tile j
  // setmaxnreg: 128 x 24 + 256 x 240 (or 384 x 160) = 64512 <= 65536 registers of the SM (one block per SM). Three
  // consumer warpgroups at 160 hold S (Bc / 2), P (Bc / 4) and O (d / 2): Bc 128 at d 64, not 192.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 2 ? 240 : 160;
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
  // Layout (byte offsets from a 1024-byte aligned base): Q | K[kStages] | V[kStages] | [O] | mbarriers.
  static constexpr int kSmemQ = 0;
  static constexpr int kSmemK = kSmemQ + kQBytes;
  static constexpr int kSmemV = kSmemK + kStages * kKVBytes;
  static constexpr int kBarriers = 2 + 4 * kStages;  // Q full, Q empty; K full, V full, K empty, V empty per stage
  // O is staged in its own buffer where one fits (the next tile's Q then arrives under this tile's epilogue), else in
  // Q's (d 128 at Bc 192: 224 KB without it).
  static constexpr bool kOwnOBuffer = kSmemV + kStages * kKVBytes + kQBytes + 8 * kBarriers + 16 + 1024 <= 227 * 1024;
  static constexpr int kSmemO = kOwnOBuffer ? kSmemV + kStages * kKVBytes : kSmemQ;
  static constexpr int kSmemBarriers = kSmemV + kStages * kKVBytes + (kOwnOBuffer ? kQBytes : 0);
  static constexpr int kSmemTile = kSmemBarriers + 8 * kBarriers;  // the work tile being loaded (an int)
  static constexpr int kSmemBytes = kSmemTile + 16 + 1024;          // + slack to align the base to 1024

  static_assert(sizeof(T) == 2, "wgmma .bf16 / .f16 operands");
  static_assert(kHeadDim % kPanelCols == 0, "head_dim is a whole number of 64-column panels");
  static_assert(kBlockN % 16 == 0 && kKVPanelBytes % 1024 == 0, "whole k-steps of P V; stages on 1024-byte atoms");
  static_assert(kHeadDim <= 256 && kBlockN <= 256 && kBlockM <= 256, "a TMA box and a wgmma N are at most 256");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one H100 block");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWarpgroups <= 65536, "the SM's registers");
  static_assert(kConsumerWarpgroups == 2 || kConsumerWarpgroups == 3, "Br 128 or 192");
};

// The plain schedule per head dim (H100, B 4, H 16, N 8192, bf16): ping-pong at d 128, 711 TFLOP/s full with Bc 176
// (overlap with Bc 128: 680; the key tile is now fwd_d128_key_tile's, by N_k). At d 64 three
// consumer warpgroups (Br 192) in ping-pong (H200, B·N 16384, H 32): 1.17-1.21x two (Br 128) full, 1.06-1.12x causal
// at N >= 8192, 0.98-1.01x at N 2048-4096 (before each warpgroup skipped the key tiles past its rows' diagonal, which
// took causal N 2048 from 0.95x to 1.02x cuDNN); Bc 192 with two is 1.03-1.09x two at Bc 128 full, 0.95-1.05x causal.
// Tried at d 128, Bc 128 (H200, bf16/fp16, N 1024-16384): two Q buffers, or Q handed back after a warpgroup's last S
// rather than its last P V, +1 to -1% full, -1 to -3% causal; one pipeline across work tiles (a tile's S_0 issued with
// the previous tile's last P V, its softmax under it) -7% full, -14% causal.
template <int kHeadDim, class T, int kBlockN = 128>
using DefaultFwdTraits = std::conditional_t<kHeadDim == 128, FwdTraits<128, T, /*kOverlap=*/true, /*kPingPong=*/true, kBlockN>,
                                            FwdTraits<kHeadDim, T, /*kOverlap=*/true, /*kPingPong=*/true, 128, 3>>;
// The plain and causal forwards' grids: persistent, their blocks taking tiles from a counter (dynamic); else the plain
// one persistent with a static schedule, the causal one a block per tile. Dynamic: causal d 64 +2-4% at N 2048-4096 on
// an H200 (335 -> 343 TFLOP/s at N 2048), plain unchanged; a static causal zigzag lost 7-25% at N >= 8192.
constexpr bool kFwdDynamicSchedule = true;
// attn_mask and windows (key spans): Bc 128 at both head dims (ptxas, d 128: 36 bytes of spill; at Bc 176, 1.5 KB).
template <int kHeadDim, class T>
using SpansFwdTraits = FwdTraits<kHeadDim, T, /*kOverlap=*/true, /*kPingPong=*/true, 128>;
// d 128 without mask or window, the key tile (Bc): 128 when causal (H200, bf16, B·N 32768, H 16, vs Bc 176: +11-14%
// at N 2048, +4-7% at 8192) or N_k <= 2048 (within 2% of 160 there, and the tile of every short sequence: a packed
// call whose longest has <= 2048 keys gives each sequence its dense call's bits); past 2048 keys, of 160 and 192 the
// one that computes fewer keys (N_k rounded up to the tile) at its speed, 1 and 1.01. H200, bf16, B·N 16384, H 16,
// same-run ratio to cuDNN for Bc 128 / 160 / 176 / 192: N 1024 0.96 / 0.90 / - / 0.86; N 2048 0.97 / 0.99 / 0.96 /
// 0.98; N 2560 - / 1.02 / - / 0.97; N 3072 - / 0.98 / 0.96 / 1.02; N 4096 0.98 / 1.02 / 0.99 / 1.00 (fp16 alike);
// N 6144 - / 1.02 / 1.02 / 1.05; N 8192 - / 1.03 / 1.03 / 1.05; N 16384 - / 1.05 / 1.04 / 1.06.
// A paged KV cache: Bc 128 at both head dims, whose pages (a multiple of kPagedKeyTile rows) hold whole key tiles.
constexpr int64_t keys_computed(int64_t kv_len, int block_n) { return (kv_len + block_n - 1) / block_n * block_n; }
constexpr int fwd_d128_key_tile(bool causal, int64_t kv_len, bool paged) {
  if (causal || paged || kv_len <= 2048) return 128;
  return keys_computed(kv_len, 192) * 100 <= keys_computed(kv_len, 160) * 101 ? 192 : 160;
}
static_assert(fwd_d128_key_tile(false, 2560, false) == 160 && fwd_d128_key_tile(false, 3072, false) == 192 &&
                  fwd_d128_key_tile(false, 4096, false) == 160 && fwd_d128_key_tile(false, 8192, false) == 192 &&
                  fwd_d128_key_tile(false, 16384, false) == 192,
              "the key tiles measured best");
constexpr int kPagedKeyTile = 128;

// ---- the backward -----------------------------------------------------------------------------------------------------
// One block = 3 warpgroups and one key tile of kBlockN = 128 keys (Bc): warpgroup 0 the producer (one thread: K, V once,
// then Q, dO, lse·log2e and D of every query tile into a kStages ring), warpgroups 1 and 2 the consumers, each owning
// 64 keys (wgmma's M) of the tile, whose dK, dV stay in its registers for the whole block. A query tile holds kBlockM
// rows (Br): the N of Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, the K of dV += Pᵀ dO and dK += dSᵀ Q. dQ_i = dS_i K (kBlockM x head_dim)
// is split into two 64 x 64 blocks, one per consumer warpgroup: by rows at Br 128 (d 64), by columns at Br 64 (d 128).
// Every (rows x 64 columns) panel is 128-byte swizzled as in the forward; dS is stored as dSᵀ, (keys, queries) in panels
// of 64 queries, the layout its fragments write with 4-byte stores and dQ's wgmma reads MN-major.
//
// kDqTma: a warpgroup's dQ block goes to shared memory, and one of its threads adds it into dq_accum with two bulk
// tensor reductions of the copy engine (FlashAttention-3's dQ path); false: 16-byte float32 reductions from the
// registers of every thread (8 per thread and step, with their shuffles).
// kDvEarly: dV += Pᵀ dO is issued as soon as Pᵀ is ready, before dPᵀ is waited for, so that dSᵀ = Pᵀ ∘ (dPᵀ − D) is
// computed while dV is on the tensor cores; false: dV is issued after dSᵀ, under dSᵀ's stores and the barrier.
// kPolyExpEvery: 0, or every kPolyExpEvery-th group of 8 query columns of Pᵀ takes its exponentials from a polynomial
// on the FMA pipe instead of the MUFU unit (16 results per clock per SM: 1024 clocks a step at d 64, more than dPᵀ's
// product they hide under), so that both units share the work.
// kDeltaVec: D = rowsum(dO ∘ O) by flash_bwd_delta_vec_kernel (16-byte loads, head_dim / 8 lanes a row); false: by
// flash_bwd.cuh's flash_bwd_delta_kernel (4-byte loads, a warp a row).
// kDqDefer (with kDqTma): a step's dQ block is written to shared memory at once, but fenced and handed to the copy
// engine in the next step, under its Sᵀ and dPᵀ products; false: at once, where the fence waits for the stores while
// the tensor cores, done with dK, have nothing to do.
template <int kHeadDim_, class T_, bool kDqTma_ = false, bool kDvEarly_ = false, int kPolyExpEvery_ = 0,
          bool kDeltaVec_ = false, int kBlockM_ = (kHeadDim_ == 64 ? 128 : 64), bool kDqDefer_ = false>
struct BwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kNThreads = 128 * (1 + kConsumerWarpgroups);  // 384
  static constexpr int kBlockN = 64 * kConsumerWarpgroups;           // keys per block (Bc)
  // Br: FlashAttention-3's tiles (128 x 128 at d 64, 64 x 128 at d 128). Registers of a consumer thread at their peak
  // (the softmax of Sᵀ): dK, dV (2 x d/2) + Sᵀ, dPᵀ (2 x Br/2) = 192 at both head dims, under the 240 it is given.
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kStages = 2;  // (Q, dO) tiles in flight: the copy of tile i + 1 runs under the products of i
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr bool kDqSplitByRows = kBlockM == 128;  // else by columns of head_dim
  static constexpr bool kDqTma = kDqTma_;
  static constexpr bool kDvEarly = kDvEarly_;
  static constexpr int kPolyExpEvery = kPolyExpEvery_;
  static constexpr bool kDeltaVec = kDeltaVec_;
  static constexpr bool kDqDefer = kDqTma_ && kDqDefer_;

  static constexpr int kPanelCols = 64;
  static constexpr int kPanels = kHeadDim / kPanelCols;
  static constexpr int kRowBytes = 128;
  static constexpr int kKVPanelBytes = kBlockN * kRowBytes;
  static constexpr int kKVBytes = kPanels * kKVPanelBytes;  // K (or V) of the block
  static constexpr int kQPanelBytes = kBlockM * kRowBytes;
  static constexpr int kQBytes = kPanels * kQPanelBytes;  // one Q (or dO) tile
  static constexpr int kDsPanelBytes = kBlockN * kRowBytes;  // 64 queries of every key
  static constexpr int kDsBytes = (kBlockM / kPanelCols) * kDsPanelBytes;
  static constexpr int kStatBytes = kBlockM * 4;  // lse·log2e (or D) of a query tile
  // kDqTma: a warpgroup's 64 x 64 float32 dQ block, as two boxes of 32 columns (128-byte swizzled rows of 64 rows).
  static constexpr int kDqBoxBytes = 64 * 128;
  static constexpr int kDqBytes = kDqTma ? 2 * kDqBoxBytes : 0;
  // Layout (byte offsets from a 1024-byte aligned base):
  //   K | V | Q[kStages] | dO[kStages] | dS[2] | dQ[kConsumerWarpgroups] | lse2[kStages] | D[kStages] | mbarriers
  // dS is double-buffered: a warpgroup writes dS_{i+1} while the other may still read dS_i in its dQ product. dQ is
  // not: its reduction of step i is issued by step i + 1's products at the latest, and read before step i + 1's dS
  // barrier, after which the block is written again.
  static constexpr int kSmemK = 0;
  static constexpr int kSmemV = kSmemK + kKVBytes;
  static constexpr int kSmemQ = kSmemV + kKVBytes;
  static constexpr int kSmemDo = kSmemQ + kStages * kQBytes;
  static constexpr int kSmemDs = kSmemDo + kStages * kQBytes;
  static constexpr int kSmemDq = kSmemDs + 2 * kDsBytes;
  static constexpr int kSmemLse = kSmemDq + kConsumerWarpgroups * kDqBytes;
  static constexpr int kSmemDelta = kSmemLse + kStages * kStatBytes;
  static constexpr int kSmemBarriers = kSmemDelta + kStages * kStatBytes;
  static constexpr int kBarriers = 1 + 4 * kStages;  // K and V full; Q full, dO full, Q empty, dO empty per stage
  static constexpr int kSmemBytes = kSmemBarriers + 8 * kBarriers + 1024;
  // Key spans (kMaskSpans) only, after the barriers (the other kernels' layout and size stay as above): per stage the
  // step the producer chose (an int4), and which of the tile's 128 keys each query row sees (128 bits a row).
  static constexpr int kSmemSteps = (kSmemBarriers + 8 * kBarriers + 15) / 16 * 16;
  static constexpr int kSmemRowBits = kSmemSteps + 16 * kStages;
  static constexpr int kSmemBytesSpans = kSmemRowBits + 16 * kStages * kBlockM + 1024;

  static_assert(sizeof(T) == 2, "wgmma .bf16 / .f16 operands");
  static_assert(kHeadDim % kPanelCols == 0 && kBlockM % kPanelCols == 0, "whole 64-column panels");
  static_assert((kBlockM / 64) * (kHeadDim / 64) == kConsumerWarpgroups, "dQ is one 64 x 64 block per warpgroup");
  static_assert(kBlockM <= 256 && kBlockN <= 256, "a TMA box and a wgmma N are at most 256");
  static_assert(kBlockN == 128, "key spans: 128 bits of keys a query row");
  static_assert(kSmemBytesSpans <= 227 * 1024, "shared memory of one H100 block");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWarpgroups <= 65536, "the SM's registers");
};

// The shipped backward per head dim: FlashAttention-3's tiles and dQ path, D with 16-byte loads, dV before dSᵀ at d 64.
// On an H200 (bf16/fp16, d 64/128, N 2048-8192): 1.11-1.25x the register-reduction dQ with dV after dSᵀ; the polynomial
// exponentials gain at d 64 causal only (+2 %) and lose elsewhere. kDvEarly at d 128: 7-8 % slower without the causal
// mask, the same with it (bf16, N 2048-8192). kDqDefer, same run vs cuDNN: +6-7 % at d 64; at d 128 +3-4 % causal and
// GQA (the causal call's unmasked tiles too), within 1 % unmasked.
template <int kHeadDim, class T>
using DefaultBwdTraits = BwdTraits<kHeadDim, T, /*kDqTma=*/true, /*kDvEarly=*/kHeadDim == 64, /*kPolyExpEvery=*/0,
                                   /*kDeltaVec=*/true, /*kBlockM=*/kHeadDim == 64 ? 128 : 64, /*kDqDefer=*/true>;

}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
