// The merge of two partial attention results on the GPU (attention.h, MergeParams; the CPU's is
// csrc/kernels/merge.cpp, the same arithmetic): ring attention folds each key block's (out_b, lse_b) into its
// running (out, lse). A warp per row: every lane computes the row's two weights (two exps, no shuffle), then the
// lanes stride the row's head_dim columns, 32 consecutive floats a step (coalesced).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
  const MergeRow<T> row = merge_row<T>(mp, i);
  float c_a, c_b;
  const float lse = merge_weights(*row.lse, row.lse_b, &c_a, &c_b);
  for (int64_t j = lane; j < mp.head_dim; j += 32) row.out[j] = row.out[j] * c_a + to_f(row.out_b[j]) * c_b;
  __syncwarp();  // every lane has read *row.lse before lane 0 writes it
  if (lane == 0) *row.lse = lse;
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
