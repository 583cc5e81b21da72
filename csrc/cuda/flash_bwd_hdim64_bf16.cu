// The backward kernels for head_dim 64, bf16 (one file per head dim and dtype, so they compile in parallel).
#include "flash_bwd.cuh"
#include "flash_launch.cuh"

namespace cs149gpt {
namespace cuda {
template <>
cudaError_t flash_bwd_run<64, __nv_bfloat16>(const AttentionBackwardParams& p, float* delta, float* dq_accum,
                                  cudaStream_t stream) {
  const int config = config_from_env("CS149GPT_BWD_CONFIG", kDefaultBwdConfig<64>);
#ifdef CS149GPT_DEFAULT_CONFIG_ONLY  // the quick compile check: the shipped configuration alone
  if (config == kDefaultBwdConfig<64>)
    return launch_flash_bwd<BwdConfig<64, kDefaultBwdConfig<64>, __nv_bfloat16>>(p, delta, dq_accum, stream);
  return cudaErrorInvalidValue;
#else
  switch (config) {
    case 1: return launch_flash_bwd<BwdConfig<64, 1, __nv_bfloat16>>(p, delta, dq_accum, stream);
    case 2: return launch_flash_bwd<BwdConfig<64, 2, __nv_bfloat16>>(p, delta, dq_accum, stream);
    case 3: return launch_flash_bwd<BwdConfig<64, 3, __nv_bfloat16>>(p, delta, dq_accum, stream);
    case 0: return launch_flash_bwd<BwdConfig<64, 0, __nv_bfloat16>>(p, delta, dq_accum, stream);
    default: return cudaErrorInvalidValue;  // no such configuration
  }
#endif
}
}  // namespace cuda
}  // namespace cs149gpt
