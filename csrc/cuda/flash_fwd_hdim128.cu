// The forward kernels for head_dim 128 (one file per head dim, so they compile in parallel).
#include "flash_fwd.cuh"
#include "flash_launch.cuh"

namespace cs149gpt {
namespace cuda {
cudaError_t flash_fwd_hdim128(const AttentionParams& p, cudaStream_t stream) {
  return p.dtype == DType::bf16 ? launch_flash_fwd<FwdConfig<128, __nv_bfloat16>>(p, stream)
                                : launch_flash_fwd<FwdConfig<128, __half>>(p, stream);
}
}  // namespace cuda
}  // namespace cs149gpt
