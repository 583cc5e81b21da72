// The per-(head dim, dtype) launchers of the Hopper forward, each compiled in its own file
// (flash_fwd_hopper_hdim<d>_<dtype>.cu, in parallel); flash_fwd_hopper.cu picks one.
#pragma once

#include <cuda_runtime.h>

#include "../../attention.h"

namespace cs149gpt {
namespace cuda {
namespace hopper {

template <int kHeadDim, class T>
cudaError_t flash_fwd_run(const AttentionParams& p, cudaStream_t stream, int* tile_counter);

}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
