// An attn_mask whose every row shows one run of consecutive keys and hides the rest (padding, padding under a
// causal pattern, a band), found by one pass over the mask (mask_ranges.cpp), so the kernels take the runs as a
// window instead of reading the mask.
#pragma once

#include <ATen/ATen.h>

namespace cs149gpt {

// ranges: int64 (first, end) per distinct mask row, (batch or 1, heads or 1, Nq or 1, 2); undefined when some row
// shows two runs or more, or the mask is left to the kernels. plain: the runs add nothing (no bias inside them).
struct KeyRanges {
  at::Tensor ranges;
  bool plain = true;
};
// mask4: (batch, heads, Nq, Nk), stride 0 where broadcast (mask_as_4d), on the CPU.
KeyRanges key_ranges_of(const at::Tensor& mask4);

}  // namespace cs149gpt
