// The Hopper forward for head_dim 128, fp16 (one file per head dim and dtype, so they compile in parallel).
#include "flash_fwd_hopper.cuh"

namespace cs149gpt {
namespace cuda {
namespace hopper {
template <>
cudaError_t flash_fwd_run<128, __half>(const AttentionParams& p, cudaStream_t stream, int* tile_counter) {
  if (has_mask_or_window(p)) return launch_flash_fwd_hopper<SpansFwdTraits<128, __half>, true>(p, stream);
  switch (fwd_d128_key_tile(p.is_causal, p.kv_len, p.block_table != nullptr)) {
    case 160: return launch_flash_fwd_hopper<DefaultFwdTraits<128, __half, 160>, false>(p, stream, tile_counter);
    case 192: return launch_flash_fwd_hopper<DefaultFwdTraits<128, __half, 192>, false>(p, stream, tile_counter);
    default: return launch_flash_fwd_hopper<DefaultFwdTraits<128, __half, 128>, false>(p, stream, tile_counter);
  }
}
}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
