// The kernels' workspace: its size bounded before any kernel computes it, and the mapping kept from call to call
// (workspace.h).
#include "workspace.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <sstream>

namespace cs149gpt {

// An upper bound, in floats, of every kernel's workspace formula (-1: beyond int64). The kernels size their
// workspace in plain int64 arithmetic, rounding tiles up to row groups and vectors (never more than 64 elements);
// for sizes that are huge while the memory behind them is not (stride-0 expanded inputs) that arithmetic would wrap
// around and hand the kernel a buffer far too small. With Q = B·H·(Nq+64)·(d+64), K = B·H·(Nk+64)·(d+64) and
// T = threads·(Nq+Nk+128)·(d+64), flash_backward.cpp's formula is below 6·Q + 8·K + 6·T; the one-pass backward
// kernels' below 9·Q + 32·T (up to 8 key chunks' partial dQ, tiles of at most 512 × 512); flash.cpp's
// below 19·K + 27·T (Bc = 1 pads every key to a vector); flash_decode.cpp's below 64·Q + 2·T (at most 64 splits of
// a row); fused.cpp's below T; naive and blocked's is Nq·Nk; flash_teaching.cpp's is S = threads·(Br·Bc + 2·Br)
// (tiles clamped to the sequences). So while 64·(Q + K + T) + Nq·Nk + S fits, none of the kernels' formulas overflows.
int64_t workspace_bound_floats(const AttentionParams& p) {
  constexpr int64_t kPad = 64, kSlack = 64;
  const int64_t heads_d = checked_product({p.batch, p.num_heads, checked_sum({p.head_dim, kPad})});  // Hkv ≤ H
  const int64_t queries = checked_product({heads_d, checked_sum({p.q_len, kPad})});
  const int64_t keys = checked_product({heads_d, checked_sum({p.kv_len, kPad})});
  const int64_t per_thread = checked_product(
      {p.num_threads, checked_sum({p.q_len, p.kv_len, 2 * kPad}), checked_sum({p.head_dim, kPad})});
  const int64_t scores = checked_product({p.q_len, p.kv_len});
  const int64_t tile = checked_product(
      {p.num_threads, checked_sum({checked_product({p.block_q, p.block_k}), checked_product({2, p.block_q})})});
  return checked_sum({checked_product({kSlack, checked_sum({queries, keys, per_thread})}), scores, tile});
}

std::string sizes_of(const AttentionParams& p) {
  std::ostringstream s;
  s << "batch " << p.batch << ", heads " << p.num_heads << " (kv heads " << p.num_kv_heads << "), q_len " << p.q_len
    << ", kv_len " << p.kv_len << ", head dim " << p.head_dim << ", " << p.num_threads << " threads";
  return s.str();
}

// A workspace of 64 KB to 64 MB lives in a mapping kept from call to call, one per calling thread (Linux; 2 MB pages
// asked for). Taken from glibc's heap and freed at the end of each call, such a buffer unsettles the heap: freed,
// it grows the heap's free top past the trim threshold, the top goes back to the system, and the next call — and
// the model's other tensors — fault their pages in again (BERT, 32 × 128, float32, on a 16-core Xeon: twice torch's
// page faults a forward, and the model at 0.65× torch's speed); a fresh mapping per call zeroes its pages every call
// instead. Kept, the pages are faulted in once. The profiler is told of the workspace as torch's allocator tells it
// of its own, allocated at the start of each call and freed at its end (memory events), so peak-memory measurements
// count it where it is used; the mapping itself stays until the thread ends (at most 64 MB; a larger workspace, or
// one asked for while the kept one is in use, gets a mapping of its own for the call). Undefined if the system
// refuses.
namespace {

#if defined(__linux__) && defined(MADV_HUGEPAGE)
struct KeptMapping {
  void* data = nullptr;
  size_t bytes = 0;
  bool in_use = false;
  ~KeptMapping() {
    if (data) munmap(data, bytes);
  }
};

void* map_pages(size_t bytes) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) return nullptr;
  (void)madvise(data, bytes, MADV_HUGEPAGE);  // a hint: ignored where transparent huge pages are off
  return data;
}
#endif

}  // namespace

at::Tensor mapped_workspace(int64_t floats) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kKeptLimit = size_t{64} << 20, kHuge = size_t{2} << 20;
  thread_local KeptMapping kept;
  const size_t bytes = static_cast<size_t>(floats) * sizeof(float);
  const int64_t signed_bytes = static_cast<int64_t>(bytes);
  const c10::Device cpu(c10::DeviceType::CPU);
  const auto report = [cpu](void* ptr, int64_t delta) {
    if (c10::memoryProfilingEnabled()) c10::reportMemoryUsageToProfiler(ptr, delta, 0, 0, cpu);
  };
  const auto options = at::TensorOptions().dtype(at::kFloat);
  if (bytes <= kKeptLimit && !kept.in_use) {
    if (kept.bytes < bytes) {
      if (kept.data) munmap(kept.data, kept.bytes);
      kept.bytes = (bytes + kHuge - 1) / kHuge * kHuge;
      kept.data = map_pages(kept.bytes);
      if (!kept.data) {
        kept.bytes = 0;
        return {};
      }
    }
    KeptMapping* owner = &kept;  // freed at the end of the call, on this thread
    at::Tensor ws = at::from_blob(kept.data, {floats}, [owner, signed_bytes, report](void* ptr) {
      report(ptr, -signed_bytes);
      owner->in_use = false;
    }, options);
    kept.in_use = true;  // only once the tensor exists (from_blob may throw)
    report(kept.data, signed_bytes);
    return ws;
  }
  void* data = map_pages(bytes);
  if (!data) return {};
  at::Tensor ws;
  try {
    ws = at::from_blob(data, {floats}, [bytes, signed_bytes, report](void* ptr) {
      report(ptr, -signed_bytes);
      munmap(ptr, bytes);
    }, options);
  } catch (...) {
    munmap(data, bytes);
    throw;
  }
  report(data, signed_bytes);
  return ws;
#else
  (void)floats;
  return {};
#endif
}

}  // namespace cs149gpt
