// From a params struct to the Hopper forward of its head dim and dtype, and the test of whether it can take the call.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../flash_cuda.h"
#include "flash_fwd_hopper_launch.h"
#include "kernel_traits.cuh"
#include "tensor_map.h"

namespace cs149gpt {
namespace cuda {
namespace {

// Compiled with the kernels' flags: its sm_90a code is what the current device loads only where the build has the
// sm_90a kernels and the device is a Hopper GPU (compute capability 9.0). An sm_90 pass without the `a` (whose Hopper
// kernels are empty stubs) reports binaryVersion 90 too; only the sm_90a pass gives the probe its static shared memory.
constexpr int kProbeSharedBytes = 16;
__global__ void sm90a_probe_kernel(int* sink) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ int marker[kProbeSharedBytes / sizeof(int)];
  marker[threadIdx.x % 4] = threadIdx.x;
  __syncthreads();
  if (sink != nullptr) *sink = marker[(threadIdx.x + 1) % 4];
#endif
}

bool device_runs_sm90a() {
  constexpr int kMaxDevices = 64;
  static int8_t known[kMaxDevices] = {};  // 0 unknown, 1 yes, -1 no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return false;
  if (device < kMaxDevices && known[device] != 0) return known[device] > 0;
  cudaFuncAttributes attr;
  const bool yes = cudaFuncGetAttributes(&attr, sm90a_probe_kernel) == cudaSuccess && attr.binaryVersion == 90 &&
                   attr.sharedSizeBytes >= kProbeSharedBytes;
  if (device < kMaxDevices) known[device] = yes ? 1 : -1;
  return yes;
}

}  // namespace

using hopper::aligned16;
using hopper::strides_ok;

// The shapes, layout and device the Hopper kernels take (forward and backward alike). The plain and causal kernels take
// the max of raw scores, the logits' max only for scale > 0, and fold the scale into exp2's argument (scale 0 would
// make a hidden key's −inf NaN): a scale <= 0 runs the general FA2 kernel (the key-spans kernel scales first, but
// shares this check).
// Packed sequences (cu_seqlens_q; both passes, without attn_mask or window): the tensor maps then span the packed
// rows (total_q, total_k), one (batch) of them; with a paged KV cache (the forward), k's and v's every page's rows, a
// page kPagedKeyTile rows or a multiple, the pages one after another in memory (a key tile is then rows of one page,
// one TMA coordinate through the table).
bool hopper_takes_shapes(const AttentionParams& p) {
  constexpr int64_t kMaxRows = int64_t{1} << 30;  // TMA coordinates are int32
  const bool packed = p.cu_seqlens_q != nullptr;
  const bool pages = p.block_table == nullptr ||
                     (packed && p.page_size % hopper::kPagedKeyTile == 0 &&
                      p.k_strides[0] == p.page_size * p.k_strides[2] && p.v_strides[0] == p.page_size * p.v_strides[2]);
  const bool call = p.dropout_p == 0.0f && !has_logit_mods(p) && pages &&
                    p.cache_seqlens == nullptr && p.k_new == nullptr && p.scale > 0.f &&
                    (!packed || (p.seq_end_q == nullptr && p.seq_end_k == nullptr && p.total_q > 0 && p.total_k > 0));
  const auto [batch, q_rows, kv_rows] = hopper::map_extent(p);
  const bool shapes = (p.dtype == DType::bf16 || p.dtype == DType::f16) && (p.head_dim == 64 || p.head_dim == 128) &&
                      p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0 && q_rows < kMaxRows &&
                      kv_rows < kMaxRows && p.batch * p.num_heads <= 65535;
  const bool layout = aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.out) &&
                      strides_ok(p.q_strides, batch, p.num_heads, q_rows) &&
                      strides_ok(p.k_strides, batch, p.num_kv_heads, kv_rows) &&
                      strides_ok(p.v_strides, batch, p.num_kv_heads, kv_rows) &&
                      strides_ok(p.out_strides, batch, p.num_heads, q_rows);
  return call && shapes && layout && device_runs_sm90a();
}

bool hopper_fwd_supports(const AttentionParams& p) {
  // attn_mask (through mask_key_bounds' key ranges), windows and causal: key spans.
  return (p.mask == nullptr || p.key_ranges != nullptr) && !(p.cu_seqlens_q != nullptr && has_mask_or_window(p)) &&
         hopper_takes_shapes(p);
}

bool hopper_fwd_takes_tile_counter(const AttentionParams& p) {
  return hopper::kFwdDynamicSchedule && !has_mask_or_window(p);
}

cudaError_t flash_fwd_hopper(const AttentionParams& p, cudaStream_t stream, int* tile_counter) {
  if (!hopper_fwd_supports(p)) return cudaErrorNotSupported;
  const bool bf16 = p.dtype == DType::bf16;
  switch (p.head_dim) {
    case 64:
      return bf16 ? hopper::flash_fwd_run<64, __nv_bfloat16>(p, stream, tile_counter)
                  : hopper::flash_fwd_run<64, __half>(p, stream, tile_counter);
    case 128:
      return bf16 ? hopper::flash_fwd_run<128, __nv_bfloat16>(p, stream, tile_counter)
                  : hopper::flash_fwd_run<128, __half>(p, stream, tile_counter);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace cs149gpt
