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
// Each thread keeps one 16-byte column chunk and walks rows kNThreads / chunks-per-row apart: one 64-bit pointer
// increment per chunk, no per-chunk multiply (the copy sits inside the kernels' loops).
template <class Tile, int kNThreads, class T>
__device__ __forceinline__ void copy_tile_async(T* smem, const T* gmem, int64_t row_stride, int rows_valid) {
  constexpr int kChunksPerRow = Tile::kCols / 8;  // 16-byte chunks
  static_assert(kNThreads % kChunksPerRow == 0 && Tile::kRows % (kNThreads / kChunksPerRow) == 0,
                "every thread copies the same number of chunks, all in one column");
  constexpr int kRowsPerPass = kNThreads / kChunksPerRow;
  const int r0 = threadIdx.x / kChunksPerRow, col = (threadIdx.x % kChunksPerRow) * 8;
  const T* src = gmem + r0 * row_stride + col;
  T* dst = smem + r0 * Tile::kStride + col;
  const int64_t src_step = kRowsPerPass * row_stride;
#pragma unroll
  for (int i = 0; i < Tile::kRows / kRowsPerPass; ++i) {
    const bool valid = r0 + i * kRowsPerPass < rows_valid;
    cp_async_16(dst + i * kRowsPerPass * Tile::kStride, valid ? src : gmem, valid);
    src += src_step;
  }
}

// copy_tile_async of the key tile and the value tile of keys n1 .. n1 + rows_valid − 1 from a paged KV cache (packed
// sequences with block_table; the sequence's view, whose table is its own row): key t is row t % page_size of page
// block_table[t / page_size], pages k_strides[0] (v_strides[0]) apart from k_head (v_head), the kv head's first row
// of page 0. One table read per row serves both tiles (K and V share the table).
template <class Tile, int kNThreads, class T>
__device__ __forceinline__ void copy_paged_kv_tiles_async(T* sK, T* sV, const T* k_head, const T* v_head,
                                                          const AttentionParams& p, int64_t n1, int rows_valid) {
  constexpr int kChunksPerRow = Tile::kCols / 8;
  constexpr int kRowsPerPass = kNThreads / kChunksPerRow;
  const int r0 = threadIdx.x / kChunksPerRow, col = (threadIdx.x % kChunksPerRow) * 8;
  const int page_size = static_cast<int>(p.page_size);
  const int offset = r0 * Tile::kStride + col;
#pragma unroll
  for (int i = 0; i < Tile::kRows / kRowsPerPass; ++i) {
    const int r = r0 + i * kRowsPerPass;
    const bool valid = r < rows_valid;
    const T *k_src = k_head, *v_src = v_head;
    if (valid) {  // (keys and pages counted in 32 bits, as block_table's)
      const int t = static_cast<int>(n1) + r, page = t / page_size, row = t - page * page_size;
      const int64_t entry = p.block_table[page];
      k_src += entry * p.k_strides[0] + row * p.k_strides[2] + col;
      v_src += entry * p.v_strides[0] + row * p.v_strides[2] + col;
    }
    cp_async_16(sK + offset + i * kRowsPerPass * Tile::kStride, k_src, valid);
    cp_async_16(sV + offset + i * kRowsPerPass * Tile::kStride, v_src, valid);
  }
}

// Copies n_valid floats (n_valid <= kCount, kCount a multiple of 4, src and dst 16-byte aligned) into shared
// memory, zeros past n_valid; asynchronous like copy_tile_async. Threads 0 .. kCount / 4 - 1 take a chunk each.
template <int kCount>
__device__ __forceinline__ void copy_floats_async(float* smem, const float* gmem, int n_valid) {
  static_assert(kCount % 4 == 0, "16-byte chunks");
  const int i = threadIdx.x * 4;
  if (i < kCount) {
    const int bytes = 4 * max(0, min(4, n_valid - i));
    cp_async_16_bytes(smem + i, bytes > 0 ? gmem + i : gmem, bytes);
  }
}

// The launch order of the blocks under a causal mask, where tiles differ in cost. Block id (a 1-D grid) -> (head,
// tile rank; rank 0 = the costliest tile). The ids run through groups of heads_per_group heads; within a group,
// rank by rank from the costliest, every head of the group at each rank. The costliest tiles start first and the
// cheap ones fill the tail, while the blocks resident together belong to few heads and share their K, V (or Q, dO)
// in L2 (heads_per_group from group_heads: a group's blocks about fill the GPU once).
struct HeadTile {
  int head, tile_rank;
};
__device__ __forceinline__ HeadTile grouped_heavy_first(int id, int heads, int tiles, int heads_per_group) {
  const int group = id / (heads_per_group * tiles);
  const int first_head = group * heads_per_group;
  const int in_group = min(heads_per_group, heads - first_head);
  const int within = id - first_head * tiles;
  return {first_head + within % in_group, within / in_group};
}

// Heads per group for grouped_heavy_first: the blocks the GPU holds at once (occupancy x SMs) over tiles per head.
template <class Kernel>
inline cudaError_t group_heads(Kernel kernel, int threads, int smem_bytes, int64_t tiles, int* heads_per_group) {
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes);
  const int64_t resident = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
  const int64_t heads = resident / (tiles > 0 ? tiles : 1);  // (host code: no min64/max64, they are __device__)
  *heads_per_group = static_cast<int>(heads < 1 ? 1 : heads > (1 << 20) ? (1 << 20) : heads);
  return err;
}

// Causal mask: query row i sees key j iff j <= i + causal_offset (and j < kv_len always).
__device__ __forceinline__ bool key_visible(const AttentionParams& p, int64_t i, int64_t j) {
  return j < p.kv_len && (!p.is_causal || j <= i + p.causal_offset);
}

}  // namespace cuda
}  // namespace cs149gpt
