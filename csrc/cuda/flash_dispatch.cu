// From a params struct to the kernels of its head dim and dtype (the tile configurations: flash_launch.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "flash_common.cuh"
#include "flash_cuda.h"
#include "flash_launch.cuh"

namespace cs149gpt {
namespace cuda {

cudaError_t flash_fwd(const AttentionParams& p, cudaStream_t stream) {
  const bool bf16 = p.dtype == DType::bf16;
  switch (p.head_dim) {
    case 64: return bf16 ? flash_fwd_run<64, __nv_bfloat16>(p, stream) : flash_fwd_run<64, __half>(p, stream);
    case 128: return bf16 ? flash_fwd_run<128, __nv_bfloat16>(p, stream) : flash_fwd_run<128, __half>(p, stream);
    default: return cudaErrorInvalidValue;  // flash_api.cpp checks fast_path_supports first
  }
}

cudaError_t flash_bwd(const AttentionBackwardParams& p, float* delta, float* dq_accum, bool dkv_per_query_head,
                      cudaStream_t stream) {
  const bool bf16 = p.fwd.dtype == DType::bf16;
  switch (p.fwd.head_dim) {
    case 64:
      return bf16 ? flash_bwd_run<64, __nv_bfloat16>(p, delta, dq_accum, dkv_per_query_head, stream)
                  : flash_bwd_run<64, __half>(p, delta, dq_accum, dkv_per_query_head, stream);
    case 128:
      return bf16 ? flash_bwd_run<128, __nv_bfloat16>(p, delta, dq_accum, dkv_per_query_head, stream)
                  : flash_bwd_run<128, __half>(p, delta, dq_accum, dkv_per_query_head, stream);
    default: return cudaErrorInvalidValue;
  }
}

// dq = scale · dq_accum in q's dtype, one pass: four floats in, four 16-bit values out per thread and step.
template <class T2>
__global__ void dq_convert_kernel(const float4* __restrict__ acc, uint2* __restrict__ dq, int64_t n4, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 a = acc[i];
    T2 lo, hi;
    if constexpr (std::is_same_v<T2, __nv_bfloat162>) {
      lo = __floats2bfloat162_rn(a.x * scale, a.y * scale);
      hi = __floats2bfloat162_rn(a.z * scale, a.w * scale);
    } else {
      lo = __floats2half2_rn(a.x * scale, a.y * scale);
      hi = __floats2half2_rn(a.z * scale, a.w * scale);
    }
    dq[i] = make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  }
}

cudaError_t dq_convert(const float* dq_accum, void* dq, int64_t n, float scale, DType dtype, cudaStream_t stream) {
  if (n % 4 || n == 0) return n == 0 ? cudaSuccess : cudaErrorInvalidValue;
  const int64_t n4 = n / 4;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n4 + threads - 1) / threads, 4096));
  const auto* acc = reinterpret_cast<const float4*>(dq_accum);
  auto* out = static_cast<uint2*>(dq);
  if (dtype == DType::bf16)
    dq_convert_kernel<__nv_bfloat162><<<blocks, threads, 0, stream>>>(acc, out, n4, scale);
  else
    dq_convert_kernel<__half2><<<blocks, threads, 0, stream>>>(acc, out, n4, scale);
  return cudaGetLastError();
}

// One warp per distinct mask row (b, h, i): the first and last key it shows (a boolean entry not 0, an additive one not
// −inf; NaN counts as shown), scanned 32 keys at a time, and whether it shows exactly the keys between them adding
// nothing (every entry there true, or 0).
__global__ void mask_key_bounds_kernel(const AttentionParams p, int64_t batch, int64_t heads, int64_t rows,
                                       int64_t* ranges) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= batch * heads * rows) return;
  const int64_t i = row % rows, h = row / rows % heads, b = row / rows / heads;
  const bool boolean = p.mask_kind == MaskKind::boolean;
  const int64_t bytes = boolean || p.mask_dtype != DType::f32 ? (boolean ? 1 : 2) : 4;
  const char* entries = static_cast<const char*>(p.mask) +
                        (b * p.mask_strides[0] + h * p.mask_strides[1] + i * p.mask_strides[2]) * bytes;
  const int64_t key_step = p.mask_strides[3] * bytes;
  int64_t first = INT64_MAX, last = -1, shown_count = 0;
  bool adds = false;  // an additive entry other than 0 and −inf
  for (int64_t j = lane; j < p.kv_len; j += 32) {
    const char* at = entries + j * key_step;
    bool shown;
    if (boolean)
      shown = *reinterpret_cast<const uint8_t*>(at) != 0;
    else {
      const float m = p.mask_dtype == DType::f32    ? *reinterpret_cast<const float*>(at)
                      : p.mask_dtype == DType::bf16 ? __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(at))
                                                    : __half2float(*reinterpret_cast<const __half*>(at));
      shown = m != -INFINITY;
      adds = adds || (shown && m != 0.f);
    }
    if (shown) {
      first = min64(first, j);
      last = j;
      ++shown_count;
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    first = min64(first, __shfl_xor_sync(0xffffffff, first, off));
    last = max64(last, __shfl_xor_sync(0xffffffff, last, off));
    shown_count += __shfl_xor_sync(0xffffffff, shown_count, off);
  }
  adds = __any_sync(0xffffffff, adds);
  if (lane == 0) {
    ranges[3 * row] = last < 0 ? 0 : first;
    ranges[3 * row + 1] = last < 0 ? 0 : last + 1;
    ranges[3 * row + 2] = !adds && (last < 0 || shown_count == last + 1 - first);
  }
}

cudaError_t mask_key_bounds(const AttentionParams& p, int64_t batch, int64_t heads, int64_t rows, int64_t* ranges,
                            cudaStream_t stream) {
  const int64_t warps = batch * heads * rows;
  if (warps == 0) return cudaSuccess;
  mask_key_bounds_kernel<<<static_cast<unsigned>((warps * 32 + 255) / 256), 256, 0, stream>>>(p, batch, heads, rows,
                                                                                            ranges);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace cs149gpt
