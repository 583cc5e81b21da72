// From a params struct to the kernels of its head dim and dtype (the tile configurations: flash_launch.cuh).
#include "flash_cuda.h"
#include "flash_launch.cuh"

namespace cs149gpt {
namespace cuda {

cudaError_t flash_fwd(const AttentionParams& p, cudaStream_t stream) {
  const bool bf16 = p.dtype == DType::bf16;
  switch (p.head_dim) {
    case 64: return bf16 ? flash_fwd_run<64, __nv_bfloat16>(p, stream) : flash_fwd_run<64, __half>(p, stream);
    case 128: return bf16 ? flash_fwd_run<128, __nv_bfloat16>(p, stream) : flash_fwd_run<128, __half>(p, stream);
    default: return cudaErrorInvalidValue;  // flash_api.cpp checks fast_path_supports first
  }
}

cudaError_t flash_bwd(const AttentionBackwardParams& p, float* delta, float* dq_accum, bool dkv_per_query_head,
                      cudaStream_t stream) {
  const bool bf16 = p.fwd.dtype == DType::bf16;
  switch (p.fwd.head_dim) {
    case 64:
      return bf16 ? flash_bwd_run<64, __nv_bfloat16>(p, delta, dq_accum, dkv_per_query_head, stream)
                  : flash_bwd_run<64, __half>(p, delta, dq_accum, dkv_per_query_head, stream);
    case 128:
      return bf16 ? flash_bwd_run<128, __nv_bfloat16>(p, delta, dq_accum, dkv_per_query_head, stream)
                  : flash_bwd_run<128, __half>(p, delta, dq_accum, dkv_per_query_head, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace cs149gpt
