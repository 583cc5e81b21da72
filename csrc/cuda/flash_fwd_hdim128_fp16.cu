// The forward kernels for head_dim 128, fp16 (one file per head dim and dtype, so they compile in parallel).
#include "flash_fwd.cuh"
#include "flash_launch.cuh"

namespace cs149gpt {
namespace cuda {
template <>
cudaError_t flash_fwd_run<128, __half>(const AttentionParams& p, cudaStream_t stream) {
  const int config = config_from_env("CS149GPT_FWD_CONFIG", kDefaultFwdConfig<128>);
#ifdef CS149GPT_DEFAULT_CONFIG_ONLY  // the quick compile check: the shipped configuration alone
  if (config == kDefaultFwdConfig<128>)
    return launch_flash_fwd<FwdConfig<128, kDefaultFwdConfig<128>, __half>>(p, stream);
  return cudaErrorInvalidValue;
#else
  switch (config) {
    case 1: return launch_flash_fwd<FwdConfig<128, 1, __half>>(p, stream);
    case 2: return launch_flash_fwd<FwdConfig<128, 2, __half>>(p, stream);
    case 3: return launch_flash_fwd<FwdConfig<128, 3, __half>>(p, stream);
    case 4: return launch_flash_fwd<FwdConfig<128, 4, __half>>(p, stream);
    case 5: return launch_flash_fwd<FwdConfig<128, 5, __half>>(p, stream);
    case 0: return launch_flash_fwd<FwdConfig<128, 0, __half>>(p, stream);
    default: return cudaErrorInvalidValue;  // no such configuration
  }
#endif
}
}  // namespace cuda
}  // namespace cs149gpt
