// From a params struct to the kernel of its head dim (the tile configurations: flash_launch.cuh).
#include "flash_cuda.h"
#include "flash_launch.cuh"

namespace cs149gpt {
namespace cuda {

cudaError_t flash_fwd(const AttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return flash_fwd_hdim64(p, stream);
    case 128: return flash_fwd_hdim128(p, stream);
    default: return cudaErrorInvalidValue;  // flash_api.cpp checks fast_path_supports first
  }
}

cudaError_t flash_bwd(const AttentionBackwardParams& p, float* delta, float* dq_accum, cudaStream_t stream) {
  switch (p.fwd.head_dim) {
    case 64: return flash_bwd_hdim64(p, delta, dq_accum, stream);
    case 128: return flash_bwd_hdim128(p, delta, dq_accum, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace cs149gpt
