// The merge of two partial attention results on the GPU (attention.h, MergeParams; the CPU's is
// csrc/kernels/merge.cpp, the same arithmetic): ring attention folds each key block's (out_b, lse_b) into its
// running (out, lse). A warp per row: every lane computes the row's two weights (two exps, no shuffle), then the
// lanes stride the row's head_dim columns, 32 consecutive floats a step (coalesced).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "flash_cuda.h"

namespace cs149gpt {
namespace cuda {
namespace {

constexpr int kMergeRowsPerBlock = 8;  // a warp each

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <class T>
__global__ void __launch_bounds__(32 * kMergeRowsPerBlock) merge_kernel(const MergeParams mp) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kMergeRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= mp.batch * mp.heads * mp.rows) return;
  const int64_t b = i / (mp.heads * mp.rows), h = i / mp.rows % mp.heads, r = i % mp.rows;
  float* lse = mp.lse + b * mp.lse_strides[0] + h * mp.lse_strides[1] + r * mp.lse_strides[2];
  const float lse_b = mp.lse_b[b * mp.lse_b_strides[0] + h * mp.lse_b_strides[1] + r * mp.lse_b_strides[2]];
  float* out = mp.out + b * mp.out_strides[0] + h * mp.out_strides[1] + r * mp.out_strides[2];
  const T* out_b =
      static_cast<const T*>(mp.out_b) + b * mp.out_b_strides[0] + h * mp.out_b_strides[1] + r * mp.out_b_strides[2];
  const float a = *lse;
  float m = (isnan(a) || isnan(lse_b)) ? NAN : fmaxf(a, lse_b);
  if (m == -INFINITY) m = 0.0f;  // no key on either side: weights 0, lse −inf
  const float w_a = expf(a - m), w_b = expf(lse_b - m), sum = w_a + w_b;
  const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;
  const float c_a = w_a * inv, c_b = w_b * inv;
  for (int64_t j = lane; j < mp.head_dim; j += 32) out[j] = out[j] * c_a + to_f(out_b[j]) * c_b;
  __syncwarp();  // every lane has read *lse before lane 0 writes it
  if (lane == 0) *lse = m + logf(sum);
}

}  // namespace

cudaError_t merge_partial(const MergeParams& mp, cudaStream_t stream) {
  const int64_t rows = mp.batch * mp.heads * mp.rows;
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows + kMergeRowsPerBlock - 1) / kMergeRowsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks)), block(32 * kMergeRowsPerBlock);
  switch (mp.dtype) {
    case DType::f32: merge_kernel<float><<<grid, block, 0, stream>>>(mp); break;
    case DType::bf16: merge_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(mp); break;
    case DType::f16: merge_kernel<__half><<<grid, block, 0, stream>>>(mp); break;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace cs149gpt
