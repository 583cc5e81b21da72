// The Hopper forward for head_dim 64, fp16 (one file per head dim and dtype, so they compile in parallel).
#include "flash_fwd_hopper.cuh"

namespace cs149gpt {
namespace cuda {
namespace hopper {
template <>
cudaError_t flash_fwd_run<64, __half>(const AttentionParams& p, cudaStream_t stream, int* tile_counter) {
  if (has_mask_or_window(p)) return launch_flash_fwd_hopper<SpansFwdTraits<64, __half>, true>(p, stream);
  return launch_flash_fwd_hopper<DefaultFwdTraits<64, __half>, false>(p, stream, tile_counter);
}
}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
