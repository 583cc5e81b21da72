// The kernels' workspace (workspace.cpp): kernels allocate nothing; the Tensor edge sizes their float32 workspace by
// the kernel's own formula, checks it fits, and hands it over.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "attention.h"
#include "checks.h"

namespace cs149gpt {

// An upper bound, in floats, of every kernel's workspace formula (-1: beyond int64): while it fits, none of the
// kernels' formulas overflows.
int64_t workspace_bound_floats(const AttentionParams& p);
// The sizes of a call, to word an error.
std::string sizes_of(const AttentionParams& p);
// A float32 buffer of `floats` in a mapping (kept from call to call, per thread, up to 64 MB); undefined if the
// system refuses or there is no mmap.
at::Tensor mapped_workspace(int64_t floats);

// A kernel's workspace: a mapping when large (mapped_workspace), else through torch's allocator; the profiler
// counts both, and a failure is a Python exception. The kernel's own formula runs only once the bound says it
// cannot overflow.
template <class Params, class K>
at::Tensor workspace(const K& kernel, const Params& params, const AttentionParams& p, const std::string& what) {
  const int64_t bound = workspace_bound_floats(p);
  const bool formula_fits = bound >= 0 && bound <= INT64_MAX / static_cast<int64_t>(sizeof(float));
  const int64_t floats = formula_fits ? kernel.workspace_floats(params) : -1;
  check_fits(floats, sizeof(float), [&] { return what + " for " + sizes_of(p); });
  constexpr int64_t kOwnMappingFloats = int64_t{1} << 14;  // 64 KB
  if (floats >= kOwnMappingFloats) {
    at::Tensor mapped = mapped_workspace(floats);
    if (mapped.defined()) return mapped;
  }
  return at::empty({floats}, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace cs149gpt
