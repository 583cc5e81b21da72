// From a params struct to the Hopper backward of its head dim and dtype, and the test of whether it can take the call.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../flash_cuda.h"
#include "flash_bwd_hopper_launch.h"
#include "tensor_map.h"

namespace cs149gpt {
namespace cuda {

// The forward's conditions on q, k, v, out, the call and the device (out is read only by the delta kernel, but the
// same alignment costs nothing), plus: lse given, dout read by TMA like q, dk and dv written with 4-byte stores.
// Windows and a boolean attn_mask as key spans (an additive one: FlashAttention-2's kernel, whose logits take its
// values), packed sequences without them, as the forward takes them.
bool hopper_bwd_supports(const AttentionBackwardParams& bp) {
  const AttentionParams& p = bp.fwd;
  const auto aligned4 = [](const void* ptr, const int64_t (&strides)[3]) {
    return reinterpret_cast<uintptr_t>(ptr) % 4 == 0 && strides[0] % 2 == 0 && strides[1] % 2 == 0 &&
           strides[2] % 2 == 0;
  };
  const hopper::MapExtent ext = hopper::map_extent(p);
  return p.lse != nullptr && hopper::aligned16(bp.dout) &&
         hopper::strides_ok(bp.dout_strides, ext.batch, p.num_heads, ext.q_rows) && aligned4(bp.dk, bp.dk_strides) &&
         aligned4(bp.dv, bp.dv_strides) && p.mask_kind != MaskKind::additive && hopper_fwd_supports(p);
}

cudaError_t flash_bwd_hopper(const AttentionBackwardParams& p, float* delta, float* dq_accum, bool dkv_per_query_head,
                             cudaStream_t stream) {
  if (!hopper_bwd_supports(p)) return cudaErrorNotSupported;
  const bool bf16 = p.fwd.dtype == DType::bf16;
  switch (p.fwd.head_dim) {
    case 64:
      return bf16 ? hopper::flash_bwd_run<64, __nv_bfloat16>(p, delta, dq_accum, dkv_per_query_head, stream)
                  : hopper::flash_bwd_run<64, __half>(p, delta, dq_accum, dkv_per_query_head, stream);
    case 128:
      return bf16 ? hopper::flash_bwd_run<128, __nv_bfloat16>(p, delta, dq_accum, dkv_per_query_head, stream)
                  : hopper::flash_bwd_run<128, __half>(p, delta, dq_accum, dkv_per_query_head, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace cs149gpt
