// The forward kernels for head_dim 128, bf16 (one file per head dim and dtype, so they compile in parallel).
#include "flash_fwd.cuh"
#include "flash_launch.cuh"

namespace cs149gpt {
namespace cuda {
template <>
cudaError_t flash_fwd_run<128, __nv_bfloat16>(const AttentionParams& p, cudaStream_t stream) {
  return launch_fwd<128, __nv_bfloat16>(config_from_env("CS149GPT_FWD_CONFIG", kDefaultFwdConfig<128>), p, stream);
}
}  // namespace cuda
}  // namespace cs149gpt
