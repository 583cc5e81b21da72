// From a params struct to the kernels of its head dim and dtype (the tile configurations: flash_launch.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

}  // namespace cuda
}  // namespace cs149gpt
