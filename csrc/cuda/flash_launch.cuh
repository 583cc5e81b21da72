// The tile configurations of the tensor-core kernels, and the dispatch from a params struct to a kernel.
//
// Each (head dim, dtype) pair compiles in its own file (flash_{fwd,bwd}_hdim<d>_<dtype>.cu), in parallel.
// A few configurations are compiled for each; CS149GPT_FWD_CONFIG / CS149GPT_BWD_CONFIG = 0, 1, ... pick one at
// run time (for sweeps); unset, the measured best (kDefault*Config).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>

#include "../attention.h"
#include "kernel_traits.cuh"

namespace cs149gpt {
namespace cuda {

inline int config_from_env(const char* name, int default_config) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::atoi(value) : default_config;
}

// The defaults, the fastest of each sweep of the configurations on an H100.
// Forward: d 64 -> 3 (4 warps x 32 rows, block_k 64, Q in registers); d 128 -> 5 (4 warps x 32 rows, block_k 64,
// Q from shared memory: FlashAttention-2's own shape). Backward: 0 (FlashAttention-2's tiles) at both head dims.
template <int kHeadDim> constexpr int kDefaultFwdConfig = kHeadDim == 64 ? 3 : 5;
template <int kHeadDim> constexpr int kDefaultBwdConfig = 0;

// Forward: warps x kMi x 16 query rows per block (block_q), block_k keys per tile; kMi = 2 makes every K, V
// fragment a warp loads feed two mma. FwdTraits<head_dim, warps, block_k, T, kMi, Q in registers>.
template <int kHeadDim, int kConfig, class T> struct FwdConfigOf;
//   config 0: 8 warps, block_k 128 (d = 64) / 64 (d = 128)
template <class T> struct FwdConfigOf<64, 0, T> { using type = FwdTraits<64, 8, 128, T>; };
template <class T> struct FwdConfigOf<128, 0, T> { using type = FwdTraits<128, 8, 64, T>; };
//   config 1: 8 warps, block_k 64 / 128
template <class T> struct FwdConfigOf<64, 1, T> { using type = FwdTraits<64, 8, 64, T>; };
template <class T> struct FwdConfigOf<128, 1, T> { using type = FwdTraits<128, 8, 128, T>; };
//   config 2: 4 warps (two blocks per SM), block_k as 0
template <class T> struct FwdConfigOf<64, 2, T> { using type = FwdTraits<64, 4, 128, T>; };
template <class T> struct FwdConfigOf<128, 2, T> { using type = FwdTraits<128, 4, 64, T>; };
//   config 3: 4 warps of 32 rows; d 64: block_k 64, Q in registers; d 128: block_k 32, Q from shared memory
template <class T> struct FwdConfigOf<64, 3, T> { using type = FwdTraits<64, 4, 64, T, 2, true>; };
template <class T> struct FwdConfigOf<128, 3, T> { using type = FwdTraits<128, 4, 32, T, 2, false>; };
//   config 4: as 3 with 8 warps (block_q 256: K, V copied once for twice the rows)
template <class T> struct FwdConfigOf<64, 4, T> { using type = FwdTraits<64, 8, 64, T, 2, true>; };
template <class T> struct FwdConfigOf<128, 4, T> { using type = FwdTraits<128, 8, 32, T, 2, false>; };
//   config 5: 4 warps of 32 rows, block_k 64, Q from shared memory (d 128 spills a little)
template <class T> struct FwdConfigOf<64, 5, T> { using type = FwdTraits<64, 4, 64, T, 2, false>; };
template <class T> struct FwdConfigOf<128, 5, T> { using type = FwdTraits<128, 4, 64, T, 2, false>; };
//   config 6: as 3 (d 64) / 5 (d 128) with block_k 48: a third fewer score registers than 64
template <class T> struct FwdConfigOf<64, 6, T> { using type = FwdTraits<64, 4, 48, T, 2, true>; };
template <class T> struct FwdConfigOf<128, 6, T> { using type = FwdTraits<128, 4, 48, T, 2, false>; };
template <int kHeadDim, int kConfig, class T>
using FwdConfig = typename FwdConfigOf<kHeadDim, kConfig, T>::type;
constexpr int kFwdConfigs = 7;

// Backward: BwdTraits<head_dim, block_q, block_k, warps, warp grids of Sᵀ/dPᵀ (keys), dK/dV (keys), dQ (rows)>.
template <int kHeadDim, int kConfig, class T> struct BwdConfigOf;
//   config 0: FlashAttention-2's tiles: d 128: block_q 64, block_k 128, 8 warps; Sᵀ 32 x 32, dK/dV 32 x 64,
//             dQ 32 x 32 per warp.  d 64: block_q 128, block_k 128; Sᵀ 32 x 64, dK/dV 32 x 32, dQ 32 x 32.
template <class T> struct BwdConfigOf<64, 0, T> { using type = BwdTraits<64, 128, 128, 8, 4, 4, 4, T>; };
template <class T> struct BwdConfigOf<128, 0, T> { using type = BwdTraits<128, 64, 128, 8, 4, 4, 2, T>; };
//   config 1: the tiles of the earlier kernel (each warp 16 keys: Sᵀ 16 x 64, dK/dV 16 x head_dim), block_q 64
template <class T> struct BwdConfigOf<64, 1, T> { using type = BwdTraits<64, 64, 128, 8, 8, 8, 4, T>; };
template <class T> struct BwdConfigOf<128, 1, T> { using type = BwdTraits<128, 64, 128, 8, 8, 8, 4, T>; };
//   config 2: d 64: block_q 64, 8 warps, 32 x 32 warp tiles everywhere;  d 128: block_q 32 (Sᵀ 32 x 16)
template <class T> struct BwdConfigOf<64, 2, T> { using type = BwdTraits<64, 64, 128, 8, 4, 4, 2, T>; };
template <class T> struct BwdConfigOf<128, 2, T> { using type = BwdTraits<128, 32, 128, 8, 4, 4, 2, T>; };
//   config 3: d 64: 4 warps, block_q 64, block_k 64 (less shared memory: more blocks per SM);
//             d 128: as 0 with dQ 16 x 64 per warp
template <class T> struct BwdConfigOf<64, 3, T> { using type = BwdTraits<64, 64, 64, 4, 2, 2, 2, T>; };
template <class T> struct BwdConfigOf<128, 3, T> { using type = BwdTraits<128, 64, 128, 8, 4, 4, 4, T>; };
template <int kHeadDim, int kConfig, class T>
using BwdConfig = typename BwdConfigOf<kHeadDim, kConfig, T>::type;
constexpr int kBwdConfigs = 4;

// Launches (flash_fwd.cuh, flash_bwd.cuh) and the run-time choice among the compiled configurations.
template <class Traits>
cudaError_t launch_flash_fwd(const AttentionParams& p, cudaStream_t stream);
template <class Traits>
cudaError_t launch_flash_bwd(const AttentionBackwardParams& bp, float* delta, float* dq_accum, bool per_query_head,
                             cudaStream_t stream);

// Configuration `config` of kConfig .. kFwdConfigs - 1 (cudaErrorInvalidValue if none). With
// CS149GPT_DEFAULT_CONFIG_ONLY (the quick compile check) only the default is compiled.
template <int kHeadDim, class T, int kConfig = 0>
cudaError_t launch_fwd_config(int config, const AttentionParams& p, cudaStream_t stream) {
  if constexpr (kConfig >= kFwdConfigs) {
    return cudaErrorInvalidValue;
  } else {
#ifdef CS149GPT_DEFAULT_CONFIG_ONLY
    constexpr bool kCompiled = kConfig == kDefaultFwdConfig<kHeadDim>;
#else
    constexpr bool kCompiled = true;
#endif
    if constexpr (kCompiled)
      if (config == kConfig) return launch_flash_fwd<FwdConfig<kHeadDim, kConfig, T>>(p, stream);
    return launch_fwd_config<kHeadDim, T, kConfig + 1>(config, p, stream);
  }
}
template <int kHeadDim, class T, int kConfig = 0>
cudaError_t launch_bwd_config(int config, const AttentionBackwardParams& p, float* delta, float* dq_accum,
                              bool per_query_head, cudaStream_t stream) {
  if constexpr (kConfig >= kBwdConfigs) {
    return cudaErrorInvalidValue;
  } else {
#ifdef CS149GPT_DEFAULT_CONFIG_ONLY
    constexpr bool kCompiled = kConfig == kDefaultBwdConfig<kHeadDim>;
#else
    constexpr bool kCompiled = true;
#endif
    if constexpr (kCompiled)
      if (config == kConfig)
        return launch_flash_bwd<BwdConfig<kHeadDim, kConfig, T>>(p, delta, dq_accum, per_query_head, stream);
    return launch_bwd_config<kHeadDim, T, kConfig + 1>(config, p, delta, dq_accum, per_query_head, stream);
  }
}

// A call with attn_mask, a window, softcap, ALiBi or dropout (needs_general_kernel, flash_mask.cuh) runs the general
// kernel, compiled in one configuration per head dim: of those it could take, the one whose general instantiation
// spills least (ptxas, sm_90a: at most 80 bytes, where the defaults spill 0.4-0.6 KB): forward d 64 -> 5, d 128 -> 3;
// backward 2 at both. Any other call runs configuration `config`.
template <int kHeadDim> constexpr int kGeneralFwdConfig = kHeadDim == 64 ? 5 : 3;
template <int kHeadDim> constexpr int kGeneralBwdConfig = 2;
template <class Traits>
cudaError_t launch_flash_fwd_general(const AttentionParams& p, cudaStream_t stream);
template <class Traits>
cudaError_t launch_flash_bwd_general(const AttentionBackwardParams& bp, float* delta, float* dq_accum,
                                     bool per_query_head, cudaStream_t stream);
// A scale <= 0 too: the plain kernels take the max of raw scores, the logits' max only for scale > 0, and fold the
// scale into exp2's argument, where scale 0 turns a hidden key's −inf into NaN.
inline bool needs_general_kernel(const AttentionParams& p) {
  return has_mask_or_window(p) || has_logit_mods(p) || p.dropout_p > 0.0f || p.scale <= 0.0f;
}
template <int kHeadDim, class T>
cudaError_t launch_fwd(int config, const AttentionParams& p, cudaStream_t stream) {
  if (needs_general_kernel(p))
    return launch_flash_fwd_general<FwdConfig<kHeadDim, kGeneralFwdConfig<kHeadDim>, T>>(p, stream);
  return launch_fwd_config<kHeadDim, T>(config, p, stream);
}
template <int kHeadDim, class T>
cudaError_t launch_bwd(int config, const AttentionBackwardParams& p, float* delta, float* dq_accum,
                       bool per_query_head, cudaStream_t stream) {
  if (needs_general_kernel(p.fwd))
    return launch_flash_bwd_general<BwdConfig<kHeadDim, kGeneralBwdConfig<kHeadDim>, T>>(p, delta, dq_accum,
                                                                                          per_query_head, stream);
  return launch_bwd_config<kHeadDim, T>(config, p, delta, dq_accum, per_query_head, stream);
}

template <int kHeadDim, class T>
cudaError_t flash_fwd_run(const AttentionParams& p, cudaStream_t stream);
template <int kHeadDim, class T>
cudaError_t flash_bwd_run(const AttentionBackwardParams& p, float* delta, float* dq_accum, bool per_query_head,
                          cudaStream_t stream);

}  // namespace cuda
}  // namespace cs149gpt
