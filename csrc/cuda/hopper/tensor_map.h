// Host side of the copy engine: the tensor maps (TMA descriptors) of q, k, v, built from the params' pointers and
// strides. cuTensorMapEncodeTiled is a driver function; it is looked up through the runtime
// (cudaGetDriverEntryPoint), so the module links no libcuda.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../../attention.h"

namespace cs149gpt {
namespace cuda {
namespace hopper {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled (CUDA 12.0's signature), or null where the driver has none.
inline EncodeTiledFn encode_tiled_fn() {
  static const EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                                             &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &found);
#endif
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiledFn>(ptr)
                                                                      : nullptr;
  }();
  return fn;
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Strides (elements, [batch, head, row]) that TMA takes and 16-byte stores keep aligned: multiples of 8 elements,
// except along dimensions of size 1, whose stride is never used.
inline bool strides_ok(const int64_t (&strides)[3], int64_t batch, int64_t heads, int64_t rows) {
  const int64_t sizes[3] = {batch, heads, rows};
  for (int i = 0; i < 3; ++i)
    if (sizes[i] > 1 && (strides[i] % 8 != 0 || strides[i] <= 0 || strides[i] >= (int64_t{1} << 38))) return false;
  return true;
}

// The extent of q's, and of k's and v's, tensor maps: (batch, rows) of the call, or with packed sequences one batch of
// the packed rows (a sequence's first row is cu_seqlens[b]); a paged cache's k and v: every page's rows, one page after
// another (hopper_takes_shapes checks that they are).
struct MapExtent {
  int64_t batch, q_rows, kv_rows;
};
inline MapExtent map_extent(const AttentionParams& p) {
  if (p.cu_seqlens_q != nullptr) return {1, p.total_q, p.block_table ? p.num_pages * p.page_size : p.total_k};
  return {p.batch, p.q_len, p.kv_len};
}

// A 4-D map over (head_dim, rows, heads, batch), innermost first, with the tensor's own strides (elements; [batch,
// head, row] as in AttentionParams), read in boxes of (64 columns, box_rows rows, 1 head, 1 batch) into 128-byte
// swizzled shared memory. Rows past `rows` read as zeros, so a tile that runs off a sequence never touches the next
// head. A stride of a dimension of size 1 is never used: it is replaced by one TMA accepts.
inline cudaError_t make_head_rows_map(CUtensorMap* map, DType dtype, const void* base, int64_t head_dim, int64_t rows,
                                      int64_t heads, int64_t batch, const int64_t (&strides)[3], int box_rows) {
  const EncodeTiledFn encode = encode_tiled_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  const int64_t elem = 2;
  const int64_t row_bytes = head_dim * elem;
  const auto usable = [&](int64_t size, int64_t stride) { return size > 1 ? stride * elem : row_bytes; };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(rows > 0 ? rows : 1),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t byte_strides[3] = {static_cast<cuuint64_t>(usable(rows, strides[2])),
                                      static_cast<cuuint64_t>(usable(heads, strides[1])),
                                      static_cast<cuuint64_t>(usable(batch, strides[0]))};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult res = encode(map, dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                              4, const_cast<void*>(base), dims, byte_strides, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The map of the backward's dq_accum, (batch, heads, rows, head_dim) float32 and contiguous, over (head_dim, rows,
// heads, batch) innermost first, in boxes of (32 columns, 64 rows, 1, 1): 128-byte rows, swizzled as the 16-bit maps'.
// The kernel adds shared-memory boxes into it (tma_reduce_add_4d); rows past `rows` are dropped.
inline cudaError_t make_dq_accum_map(CUtensorMap* map, float* dq_accum, int64_t head_dim, int64_t rows, int64_t heads,
                                     int64_t batch) {
  const EncodeTiledFn encode = encode_tiled_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  const int64_t row_bytes = head_dim * 4, r = rows > 0 ? rows : 1;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(r),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t byte_strides[3] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(r * row_bytes),
                                      static_cast<cuuint64_t>(heads * r * row_bytes)};
  const cuuint32_t box[4] = {32, 64, 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult res = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, dq_accum, dims, byte_strides, box,
                              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
