// What the CUDA flash kernels share: where a head's rows start, tile copies, the causal limits.
#pragma once

#include <cstdint>

#include "../attention.h"
#include "mma.cuh"

namespace cs149gpt {
namespace cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// The first row of (batch b, head h) of a tensor with element strides [batch, head, row].
template <class T>
__device__ __forceinline__ T* head_ptr(T* base, const int64_t (&strides)[3], int64_t b, int64_t h) {
  return base + b * strides[0] + h * strides[1];
}

// Copies rows [0, rows_valid) of a kRows x head_dim tile from global memory (rows `row_stride` elements apart,
// columns contiguous) into a padded shared-memory tile; rows past rows_valid become zeros. Asynchronous:
// the block waits with cp_async_wait + __syncthreads before reading it.
template <class Tile, int kNThreads, class T>
__device__ __forceinline__ void copy_tile_async(T* smem, const T* gmem, int64_t row_stride, int rows_valid) {
  constexpr int kChunksPerRow = Tile::kCols / 8;  // 16-byte chunks
  constexpr int kChunks = Tile::kRows * kChunksPerRow;
  static_assert(kChunks % kNThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < kChunks / kNThreads; ++i) {
    const int c = i * kNThreads + threadIdx.x;
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const bool valid = r < rows_valid;
    cp_async_16(smem + r * Tile::kStride + col, valid ? gmem + r * row_stride + col : gmem, valid);
  }
}

// Causal mask: query row i sees key j iff j <= i + causal_offset (and j < kv_len always).
__device__ __forceinline__ bool key_visible(const AttentionParams& p, int64_t i, int64_t j) {
  return j < p.kv_len && (!p.is_causal || j <= i + p.causal_offset);
}

}  // namespace cuda
}  // namespace cs149gpt
