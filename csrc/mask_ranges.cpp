// The mask-data scan: an attn_mask whose every row shows one run of keys, as those runs (mask_ranges.h).
#include "mask_ranges.h"

#include <ATen/Parallel.h>

#include <array>
#include <atomic>
#include <type_traits>

#include "heuristics.h"

namespace cs149gpt {
namespace {

// A mask entry as its bits, for the scan below: whether it shows its key (true; an additive 0 of either sign) and
// whether it hides it (false; an additive −inf). An additive entry that does neither is a real bias.
struct BoolEntry {
  using Bits = uint8_t;
  static bool shows(Bits x) { return x != 0; }
  static bool hides(Bits x) { return x == 0; }
};
template <class B, B kNegInf>
struct AdditiveEntry {
  using Bits = B;
  static bool shows(Bits x) { return static_cast<Bits>(x << 1) == 0; }  // ±0: the sign bit shifted out
  static bool hides(Bits x) { return x == kNegInf; }
};
using FloatEntry = AdditiveEntry<uint32_t, 0xFF800000u>;
using BFloat16Entry = AdditiveEntry<uint16_t, 0xFF80u>;
using HalfEntry = AdditiveEntry<uint16_t, 0xFC00u>;

// The first and one past the last key that row[0, n) does not hide (0, 0 if none), and whether it hides every other
// key: whether a mask row is one run of consecutive keys. *plain: whether every key of the run adds 0 (a boolean
// row's always do); else the run adds a bias (any other entry: a value, NaN, +inf).
template <class Entry>
bool one_run(const typename Entry::Bits* row, int64_t n, int64_t* first, int64_t* end, bool* plain) {
  int64_t hidden = 0, zeros = 0;
  for (int64_t t = 0; t < n; ++t) {  // (vectorises: no early exit)
    hidden += Entry::hides(row[t]);
    zeros += Entry::shows(row[t]);
  }
  *plain = zeros + hidden == n;
  if (hidden == n) {
    *first = *end = 0;
    return true;
  }
  int64_t lo = 0, hi = n;
  while (Entry::hides(row[lo])) ++lo;
  while (Entry::hides(row[hi - 1])) --hi;
  *first = lo, *end = hi;
  return hi - lo == n - hidden;
}

// A mask (mask4: (batch, heads, Nq, Nk), stride 0 where broadcast, keys adjacent) whose every row shows one run of
// keys and hides the rest — padding on either side, padding under a causal pattern, a band: what padded batches
// pass, boolean or as an additive mask of 0 and −inf (which hides exactly what False hides, README "Non-finite
// values") — as those runs: an int64 (first, end) pair per distinct mask row, (batch or 1, heads or 1, Nq or 1, 2),
// the dims the mask is broadcast over kept at 1. Undefined when a row shows two runs or more, or the keys are strided
// (the kernels then read the mask). One pass over the mask, here, where the kernels would read each row once per
// query head and key tile, and convert every tile that an edge of padding cuts.
// `plain` says whether the runs add nothing (the kernels then take the runs instead of the mask) or add a bias inside
// them (ALiBi's or T5's position bias under a causal or padding mask): then the kernels take the runs and still read
// the mask, but only inside the runs, skipping the keys a run hides unread. That pays only where the kernels read each
// mask row several times (a bias shared by the batch, or by the heads), so a bias is taken only where each row serves
// heuristics::kMinBiasReuse (batch, head) pairs or more; a mask whose first look hides no key at all (a T5 encoder's
// bias) is left unscanned, since its runs would skip nothing.
template <class Entry>
KeyRanges key_ranges_of(const at::Tensor& mask4) {
  using Bits = typename Entry::Bits;
  std::array<int64_t, 3> extent{}, stride{};
  for (int d = 0; d < 3; ++d) {
    extent[d] = mask4.stride(d) == 0 ? 1 : mask4.size(d);
    stride[d] = mask4.stride(d);
  }
  const int64_t rows = extent[0] * extent[1] * extent[2], keys = mask4.size(3);
  const Bits* base = static_cast<const Bits*>(mask4.data_ptr());
  const auto row_of = [&](int64_t r) {
    const int64_t i = r % extent[2], h = (r / extent[2]) % extent[1], b = r / (extent[2] * extent[1]);
    return base + b * stride[0] + h * stride[1] + i * stride[2];
  };
  const bool bias_pays = mask4.size(0) * mask4.size(1) >= heuristics::kMinBiasReuse * extent[0] * extent[1];
  if (!std::is_same_v<Entry, BoolEntry>) {  // the first look: the first, middle and last rows
    bool hides_any = false, plain_all = true;
    for (const int64_t r : {int64_t{0}, rows / 2, rows - 1}) {
      int64_t first, end;
      bool plain;
      if (!one_run<Entry>(row_of(r), keys, &first, &end, &plain)) return {};
      hides_any |= end - first < keys;
      plain_all &= plain;
    }
    if (!plain_all && (!hides_any || !bias_pays)) return {};
  }
  at::Tensor ranges = at::empty({extent[0], extent[1], extent[2], 2}, at::TensorOptions().dtype(at::kLong));
  int64_t* out = ranges.data_ptr<int64_t>();
  std::atomic<bool> one_run_each{true}, plain_each{true};
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    bool plain_all = true;
    for (int64_t r = begin; r < end && one_run_each.load(std::memory_order_relaxed); ++r) {
      bool plain;
      if (!one_run<Entry>(row_of(r), keys, out + 2 * r, out + 2 * r + 1, &plain) || (!plain && !bias_pays))
        one_run_each.store(false, std::memory_order_relaxed);
      plain_all &= plain;
    }
    if (!plain_all) plain_each.store(false, std::memory_order_relaxed);
  });
  if (!one_run_each.load()) return {};
  return {ranges, plain_each.load()};
}

}  // namespace

KeyRanges key_ranges_of(const at::Tensor& mask4) {
  if (mask4.size(3) > 1 && mask4.stride(3) != 1) return {};
  switch (mask4.scalar_type()) {
    case at::kBool: return key_ranges_of<BoolEntry>(mask4);
    case at::kFloat: return key_ranges_of<FloatEntry>(mask4);
    case at::kBFloat16: return key_ranges_of<BFloat16Entry>(mask4);
    case at::kHalf: return key_ranges_of<HalfEntry>(mask4);
    default: return {};
  }
}

}  // namespace cs149gpt
