// Packed sequences (cu_seqlens) in the Hopper kernels, forward and backward: where a sequence lies in the tensor maps
// over the packed rows (tensor_map.h, map_extent), and the zeroing of a shared-memory tile's rows that belong to the
// next sequence (a tile runs past its sequence's end into them; only the tensor's end reads as zeros, and a masked
// entry weighs them by 0, but 0 · inf is NaN).
#pragma once

#include <cstdint>

#include "../../attention.h"

namespace cs149gpt {
namespace cuda {
namespace hopper {

// Sequence (or batch) b as the kernels read it: its batch coordinate in the maps (bm), where its rows start in q, out,
// lse, dout (q_row0) and in k, v, dk, dv (k_row0), its lengths and causal offset. Dense: batch b of the call. Packed:
// sequence b's rows of the one batch, bottom-right causal in it, as sequence_view (attention.h) has them without
// copying the params. In 32 bits, as TMA's coordinates (rows < 2^30: hopper_takes_shapes).
struct SequenceRows {
  int bm, q_row0, k_row0, q_len, kv_len, causal_offset;
};
__device__ __forceinline__ SequenceRows sequence_rows(const AttentionParams& p, int64_t b, bool packed) {
  if (!packed)
    return {static_cast<int>(b), 0, 0, static_cast<int>(p.q_len), static_cast<int>(p.kv_len),
            static_cast<int>(p.causal_offset)};
  const int q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
  const int q_len = p.cu_seqlens_q[b + 1] - q0, kv_len = p.cu_seqlens_k[b + 1] - k0;
  return {0, q0, k0, q_len, kv_len, kv_len - q_len};
}

// Rows first .. end − 1 of every one of kPanels panels of a tile (panels `panel_bytes` apart, 128-byte rows) set to 0,
// one 16-byte store a step of `threads` threads (index tid). The caller fences them for the async proxy and waits for
// its threads before a product reads the tile.
template <int kPanels>
__device__ __forceinline__ void zero_rows(char* tile, int panel_bytes, int first, int end, int tid, int threads) {
#pragma unroll
  for (int panel = 0; panel < kPanels; ++panel)
    for (int chunk = first * 8 + tid; chunk < end * 8; chunk += threads)
      *reinterpret_cast<uint4*>(tile + panel * panel_bytes + chunk * 16) = uint4{};
}

}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
