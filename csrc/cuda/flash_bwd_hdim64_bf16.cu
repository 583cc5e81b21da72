// The backward kernels for head_dim 64, bf16 (one file per head dim and dtype, so they compile in parallel).
#include "flash_bwd.cuh"
#include "flash_launch.cuh"

namespace cs149gpt {
namespace cuda {
template <>
cudaError_t flash_bwd_run<64, __nv_bfloat16>(const AttentionBackwardParams& p, float* delta, float* dq_accum,
                                 bool per_query_head, cudaStream_t stream) {
  return launch_bwd<64, __nv_bfloat16>(config_from_env("CS149GPT_BWD_CONFIG", kDefaultBwdConfig<64>), p, delta,
                                     dq_accum, per_query_head, stream);
}
}  // namespace cuda
}  // namespace cs149gpt
