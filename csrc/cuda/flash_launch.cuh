// The tile configurations of the tensor-core kernels, and the dispatch from a params struct to a kernel.
//
// Each (head dim, dtype) pair compiles in its own file (flash_{fwd,bwd}_hdim<d>_<dtype>.cu), in parallel.
// A few configurations are compiled for each; CS149GPT_FWD_CONFIG / CS149GPT_BWD_CONFIG = 0, 1, 2, 3 pick one
// at run time (benchmarks/bench_cuda.py --configs sweeps them); 0, the default, is the measured best.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <type_traits>

#include "../attention.h"
#include "kernel_traits.cuh"

namespace cs149gpt {
namespace cuda {

inline int config_from_env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::atoi(value) : 0;
}

// Forward: warps x kMi x 16 query rows per block (block_q), block_k keys per tile.
//   config 0: 8 warps, block_k 128 (d = 64) / 64 (d = 128)     1: 8 warps, block_k 64 / 128
//   config 2: 4 warps (two blocks per SM), block_k as 0
//   config 3: 4 warps of 32 rows (kMi 2: each K, V fragment feeds two mma); d 64: block_k 64, Q in registers;
//             d 128: block_k 32, Q re-read from shared memory
template <int kHeadDim, int kConfig, class T>
using FwdConfig = std::conditional_t<
    kConfig == 3,
    FwdTraits<kHeadDim, 4, kHeadDim == 64 ? 64 : 32, T, 2, kHeadDim == 64>,
    FwdTraits<kHeadDim, kConfig < 2 ? 8 : 4, ((kHeadDim == 64) == (kConfig % 2 == 0)) ? 128 : 64, T>>;

// Backward: warps x 16 keys per block, block_q query rows per step.
//   config 0: d 64: 8 warps, block_q 64;  d 128: 4 warps, block_q 32
//   config 1: d 64: 4 warps, d 128: 8 warps; block_q 32        config 2: 4 warps, block_q 64
template <int kHeadDim, int kConfig, class T>
using BwdConfig = BwdTraits<kHeadDim, kConfig == 2 ? 4 : kConfig == 1 ? (kHeadDim == 64 ? 4 : 8) : (kHeadDim == 64 ? 8 : 4),
                            kConfig == 2 ? 64 : kConfig == 1 ? 32 : (kHeadDim == 64 ? 64 : 32), T>;

template <int kHeadDim, class T>
cudaError_t flash_fwd_run(const AttentionParams& p, cudaStream_t stream);
template <int kHeadDim, class T>
cudaError_t flash_bwd_run(const AttentionBackwardParams& p, float* delta, float* dq_accum, cudaStream_t stream);

}  // namespace cuda
}  // namespace cs149gpt
