// The tile configuration chosen for each head dim, and the dispatch from a params struct to a kernel.
#pragma once

#include "kernel_traits.cuh"

namespace cs149gpt {
namespace cuda {

// Forward: 8 warps x 16 query rows = block_q 128; block_k 128 keys at d = 64, 64 at d = 128 (registers:
// S is 16 x block_k and O 16 x d per warp).
template <int kHeadDim, class T>
using FwdConfig = FwdTraits<kHeadDim, 8, kHeadDim == 64 ? 128 : 64, T>;

// Backward: block_k = 16 x warps keys per block, block_q = 64 query rows per step.
template <int kHeadDim, class T>
using BwdConfig = BwdTraits<kHeadDim, kHeadDim == 64 ? 8 : 4, kHeadDim == 64 ? 64 : 32, T>;

cudaError_t flash_fwd_hdim64(const AttentionParams& p, cudaStream_t stream);
cudaError_t flash_fwd_hdim128(const AttentionParams& p, cudaStream_t stream);
cudaError_t flash_bwd_hdim64(const AttentionBackwardParams& p, float* delta, float* dq_accum, cudaStream_t stream);
cudaError_t flash_bwd_hdim128(const AttentionBackwardParams& p, float* delta, float* dq_accum, cudaStream_t stream);

}  // namespace cuda
}  // namespace cs149gpt
