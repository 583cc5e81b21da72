// The backward kernels for head_dim 128 (one file per head dim, so they compile in parallel).
#include "flash_bwd.cuh"
#include "flash_launch.cuh"

namespace cs149gpt {
namespace cuda {
cudaError_t flash_bwd_hdim128(const AttentionBackwardParams& p, float* delta, float* dq_accum, cudaStream_t stream) {
  return p.fwd.dtype == DType::bf16 ? launch_flash_bwd<BwdConfig<128, __nv_bfloat16>>(p, delta, dq_accum, stream)
                                    : launch_flash_bwd<BwdConfig<128, __half>>(p, delta, dq_accum, stream);
}
}  // namespace cuda
}  // namespace cs149gpt
