// The Hopper backward for head_dim 128, bf16 (one file per head dim and dtype, so they compile in parallel).
#include "flash_bwd_hopper.cuh"

namespace cs149gpt {
namespace cuda {
namespace hopper {
template <>
cudaError_t flash_bwd_run<128, __nv_bfloat16>(const AttentionBackwardParams& p, float* delta, float* dq_accum,
                                   bool per_query_head, cudaStream_t stream) {
  return launch_flash_bwd_hopper<DefaultBwdTraits<128, __nv_bfloat16>>(p, delta, dq_accum, per_query_head, stream);
}
}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
