// The per-(head dim, dtype) launchers of the Hopper backward, each compiled in its own file
// (flash_bwd_hopper_hdim<d>_<dtype>.cu, in parallel); flash_bwd_hopper.cu picks one.
#pragma once

#include <cuda_runtime.h>

#include "../../attention.h"

namespace cs149gpt {
namespace cuda {
namespace hopper {

template <int kHeadDim, class T>
cudaError_t flash_bwd_run(const AttentionBackwardParams& p, float* delta, float* dq_accum, bool per_query_head,
                          cudaStream_t stream);

}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
