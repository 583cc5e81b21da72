// The Python face of the kernels: argument checks, shape decisions and bindings. Nothing else.
//
// Every check happens here, before a kernel runs, and fails with a Python exception that names the
// argument and what was expected. Then one AttentionParams (pointers, strides, sizes) is filled and
// handed to the kernel of the ISA chosen at load time (dispatch.cpp). Kernels never see a Tensor.
#include <torch/extension.h>
#include <torch/library.h>
#include <pybind11/stl.h>

#include <sched.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <ATen/MemoryOverlap.h>
#include <ATen/TensorUtils.h>
#include <ATen/record_function.h>

#include <array>
#include <atomic>
#include <chrono>
#include <iomanip>
#include <cmath>
#include <numeric>
#include <optional>
#include <sstream>
#include <tuple>
#include <vector>
#include <string>

#include "attention.h"

namespace cs149gpt {
namespace {

// Default tile of the blocked kernel: `benchmarks/tile_sweep.py --impl blocked` on the 2-core dev box put 32 and
// 64 level, ahead of 16, 128 and 256.
// (flash picks its own tiles from the shape and the ISA unless block_q / block_k are given: flash.cpp.)
constexpr int64_t kDefaultBlockedTile = 64;

enum class Impl { naive, blocked, fused, flash };

Impl parse_impl(const std::string& impl) {
  if (impl == "naive") return Impl::naive;
  if (impl == "blocked") return Impl::blocked;
  if (impl == "fused") return Impl::fused;
  if (impl == "flash") return Impl::flash;
  TORCH_CHECK_VALUE(false, "impl must be one of 'naive', 'blocked', 'fused', 'flash'; got '", impl, "'");
}

const char* impl_name(Impl impl) {
  switch (impl) {
    case Impl::naive: return "naive";
    case Impl::blocked: return "blocked";
    case Impl::fused: return "fused";
    case Impl::flash: return "flash";
  }
  return "?";
}

// is_causal=True is torch SDPA's top-left alignment; "bottom_right" is causal_lower_right's.
int64_t parse_causal(const std::string& causal, int64_t q_len, int64_t kv_len, bool* is_causal) {
  *is_causal = causal != "none";
  if (causal == "none" || causal == "top_left") return 0;
  if (causal == "bottom_right") return kv_len - q_len;
  TORCH_CHECK_VALUE(false, "causal must be 'none', 'top_left' or 'bottom_right'; got '", causal, "'");
}

DType parse_dtype(const at::Tensor& q, Impl impl) {
  switch (q.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kBFloat16:
    case at::kHalf:
      TORCH_CHECK_TYPE(impl == Impl::flash, "impl='", impl_name(impl),
                       "' supports float32 only, got ", q.scalar_type(), "; impl='flash' takes bfloat16 and float16");
      return q.scalar_type() == at::kBFloat16 ? DType::bf16 : DType::f16;
    default:
      TORCH_CHECK_TYPE(false, "q must be float32, bfloat16 or float16, got ", q.scalar_type());
  }
}

// A plain dense tensor of at least 2 dims. Sparse, nested and quantized tensors are refused here, by name, rather
// than left to the dispatcher's "Could not run ... with arguments from the 'SparseCPU' backend".
void check_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, name, " must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK_TYPE(!t.is_nested(), name, " must be a dense (strided) tensor, not a nested tensor");
  TORCH_CHECK_TYPE(!t.is_quantized(), name, " must be a float tensor, not quantized; got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() >= 2, name, " must have shape (..., N, d), at least 2 dims; got shape ", t.sym_sizes());
}

// All tensors of one call on one device: the CPU, or meta (shapes only, for tracing). A CPU q with meta k would
// otherwise dispatch to the meta implementation and hand back an uninitialised CPU tensor. CUDA too: the fake
// implementations check CUDA calls here (their kernels, csrc/cuda/flash_api.cpp, add the GPU's own limits).
void check_devices(std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  const auto& [first_name, first] = *tensors.begin();
  const at::Device device = first->device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_meta() || device.is_cuda(), first_name,
                    " must be on the CPU (or a CUDA GPU), got a tensor on ", device);
  bool same = true;
  for (const auto& [name, t] : tensors) same = same && t->device() == device;
  if (same) return;
  std::ostringstream names, devices;
  size_t i = 0;
  for (const auto& [name, t] : tensors) {
    names << (i == 0 ? "" : i + 1 == tensors.size() ? " and " : ", ") << name;
    devices << (i == 0 ? "" : ", ") << name << " on " << t->device();
    ++i;
  }
  TORCH_CHECK_VALUE(false, names.str(), " must be on one device, got ", devices.str());
}

// A condition on sizes that may be symbolic (torch.compile): decided now when it can be (concrete sizes; backed
// symbols, with a guard), else asserted when the compiled graph runs (unbacked sizes, from data-dependent ops such
// as nonzero, where a guard would fail the trace).
#define CHECK_SIZES(cond, ...) TORCH_CHECK_VALUE((cond).expect_true(__FILE__, __LINE__), __VA_ARGS__)

c10::SymBool equal_sizes(c10::SymIntArrayRef a, c10::SymIntArrayRef b) {
  if (a.size() != b.size()) return false;
  c10::SymBool equal = true;
  for (size_t i = 0; i < a.size(); ++i) equal = equal.sym_and(a[i].sym_eq(b[i]));
  return equal;
}

// Python floats are doubles; the kernels take scale as a float32. Doubles from this bound up round to ±inf
// (it is FLT_MAX + half an ulp), so the comparison is made in double, without an out-of-range conversion.
constexpr double kFloat32Overflow = 0x1.ffffffp+127;

// Every check of an attention call that needs no data: dtypes, devices, ranks, shapes (GQA divisibility included),
// scale, causal mode, tiles. Written on symbolic sizes, so one function serves the CPU kernels (run_attention) and
// the fake/meta implementations in ops.py (the module's check_attention, called with FakeTensors whose sizes are
// SymInts under torch.compile): eager, meta, FakeTensorMode and torch.compile refuse the same inputs with the same
// message. Returns the dtype of the call.
using OptionalTensor = std::optional<at::Tensor>;

bool is_given(const OptionalTensor& attn_mask) { return attn_mask.has_value() && attn_mask->defined(); }

// attn_mask (torch SDPA's): a dense tensor, bool (True = the key takes part) or additive (float32 or q's dtype), on
// q's device, broadcastable to the scores' shape (..., Nq, Nk) — q's leading dims and heads, Nq, k's Nk.
void check_mask(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k) {
  TORCH_CHECK_TYPE(mask.layout() == at::kStrided && !mask.is_nested(),
                   "attn_mask must be a dense (strided) tensor, got layout ", mask.layout());
  TORCH_CHECK_TYPE(!mask.is_quantized(), "attn_mask must not be quantized, got ", mask.scalar_type());
  const at::ScalarType mt = mask.scalar_type();
  TORCH_CHECK_TYPE(mt == at::kBool || mt == at::kFloat || mt == q.scalar_type(),
                   "attn_mask must be bool (True = the key takes part), float32 or q's dtype (", q.scalar_type(),
                   ") to add to the logits; got ", mt);
  std::vector<c10::SymInt> scores(q.sym_sizes().begin(), q.sym_sizes().end());
  scores.back() = k.sym_size(-2);
  std::ostringstream expected;
  expected << "attn_mask of shape " << mask.sym_sizes() << " must be broadcastable to the scores' shape "
           << c10::SymIntArrayRef(scores) << " (q's dims but the last, then k's length)";
  TORCH_CHECK_VALUE(mask.dim() <= static_cast<int64_t>(scores.size()), expected.str());
  for (int64_t i = 1; i <= mask.dim(); ++i) {
    const c10::SymInt m = mask.sym_size(-i);
    CHECK_SIZES(m.sym_eq(1).sym_or(m.sym_eq(scores[scores.size() - i])), expected.str());
  }
  check_devices({{"q", &q}, {"attn_mask", &mask}});
}

DType check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Impl impl,
                      std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                      std::optional<int64_t> block_k, const OptionalTensor& attn_mask = {}, int64_t window_left = -1,
                      int64_t window_right = -1, double dropout_p = 0.0, const OptionalTensor& dropout_seed = {}) {
  check_tensor(q, "q");
  check_tensor(k, "k");
  check_tensor(v, "v");
  check_devices({{"q", &q}, {"k", &k}, {"v", &v}});
  const DType dtype = parse_dtype(q, impl);
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "q, k and v must share one dtype, got q ", q.scalar_type(), ", k ", k.scalar_type(), ", v ",
                   v.scalar_type());
  TORCH_CHECK_VALUE(k.dim() == q.dim() && v.dim() == q.dim(), "q, k and v must have the same number of dims, got q ",
                    q.sym_sizes(), ", k ", k.sym_sizes(), ", v ", v.sym_sizes());
  const int64_t rank = q.dim();
  const c10::SymInt d = q.sym_size(-1), q_len = q.sym_size(-2), kv_len = k.sym_size(-2);
  CHECK_SIZES(d.sym_ge(1), "head dim d (the last dim of q) must be >= 1, got q of shape ", q.sym_sizes());
  CHECK_SIZES(q_len.sym_ge(1), "q must have at least one query row (dim -2), got shape ", q.sym_sizes());
  CHECK_SIZES(kv_len.sym_ge(1), "k must have at least one key row (dim -2), got shape ", k.sym_sizes());
  CHECK_SIZES(k.sym_size(-1).sym_eq(d).sym_and(v.sym_size(-1).sym_eq(d)), "k and v must have head dim d = ", d,
              " (the last dim of q), got k ", k.sym_sizes(), ", v ", v.sym_sizes());
  CHECK_SIZES(v.sym_size(-2).sym_eq(kv_len), "k and v must have the same length (dim -2), got k ", k.sym_sizes(),
              ", v ", v.sym_sizes());
  const auto lead = q.sym_sizes().slice(0, std::max<int64_t>(rank - 3, 0));
  CHECK_SIZES(equal_sizes(k.sym_sizes().slice(0, lead.size()), lead)
                  .sym_and(equal_sizes(v.sym_sizes().slice(0, lead.size()), lead)),
              "q, k and v must have the same leading dims, got q ", q.sym_sizes(), ", k ", k.sym_sizes(), ", v ",
              v.sym_sizes());
  if (rank >= 3) {
    const c10::SymInt hq = q.sym_size(-3), hkv = k.sym_size(-3);
    CHECK_SIZES(v.sym_size(-3).sym_eq(hkv), "k and v must have the same number of heads (dim -3), got k ",
                k.sym_sizes(), ", v ", v.sym_sizes());
    // First: hq % 0 must never be evaluated.
    CHECK_SIZES(hkv.sym_ge(1), "k and v must have at least one head (dim -3), got k ", k.sym_sizes(), ", v ",
                v.sym_sizes());
    CHECK_SIZES((hq % hkv).sym_eq(0), "the heads of q (dim -3) must be a multiple of those of k and v, got q ",
                q.sym_sizes(), ", k ", k.sym_sizes());
  }
  if (scale)
    TORCH_CHECK_VALUE(std::isfinite(*scale) && std::fabs(*scale) < kFloat32Overflow,
                      "scale must be a finite float32, got ", *scale);
  TORCH_CHECK_VALUE(causal == "none" || causal == "top_left" || causal == "bottom_right",
                    "causal must be 'none', 'top_left' or 'bottom_right'; got '", causal, "'");
  // Tile sizes are checked whatever the impl, so a typo is never silently ignored.
  if (block_q) TORCH_CHECK_VALUE(*block_q >= 1, "block_q must be >= 1, got ", *block_q);
  if (block_k) TORCH_CHECK_VALUE(*block_k >= 1, "block_k must be >= 1, got ", *block_k);
  if (is_given(attn_mask)) {
    TORCH_CHECK_VALUE(impl == Impl::flash, "attn_mask needs impl='flash', got impl='", impl_name(impl), "'");
    check_mask(*attn_mask, q, k);
  }
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1, "window must be (left, right) with each >= 0, or -1 "
                    "for no bound on that side; got (", window_left, ", ", window_right, ")");
  TORCH_CHECK_VALUE(impl == Impl::flash || (window_left == -1 && window_right == -1), "window needs impl='flash', "
                    "got impl='", impl_name(impl), "'");
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p must be in [0, 1), got ", dropout_p);
  if (dropout_p > 0.0) {
    TORCH_CHECK_VALUE(impl == Impl::flash, "dropout_p needs impl='flash', got impl='", impl_name(impl), "'");
    TORCH_CHECK_VALUE(is_given(dropout_seed), "dropout_p > 0 needs dropout_seed, an int64 tensor (seed, offset)");
    TORCH_CHECK_VALUE(dropout_seed->scalar_type() == at::kLong && dropout_seed->dim() == 1 &&
                          dropout_seed->sym_size(0) == 2,
                      "dropout_seed must be an int64 tensor of 2 elements (seed, offset), got ",
                      dropout_seed->scalar_type(), " of shape ", dropout_seed->sym_sizes());
    TORCH_CHECK_VALUE(dropout_seed->device().is_cpu() || dropout_seed->device().is_meta(),
                      "dropout_seed must be on the CPU, got ", dropout_seed->device());
  }
  return dtype;
}

// t is dense with like's shape and dtype (the backward's dout and out have q's; devices: check_devices).
void check_like(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name) {
  check_tensor(t, name);
  CHECK_SIZES(equal_sizes(t.sym_sizes(), like.sym_sizes()), name, " must have the shape of ", like_name, ", ",
              like.sym_sizes(), "; got ", t.sym_sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have the dtype of ", like_name, ", ",
                   like.scalar_type(), "; got ", t.scalar_type());
}

// The backward's arguments: the forward's checks on q, k, v, then dout and out shaped like q, lse like q without
// its last dim, float32; all six on one device.
DType check_attention_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& out, const at::Tensor& lse, std::optional<double> scale,
                               const std::string& causal, std::optional<int64_t> block_q,
                               std::optional<int64_t> block_k, const OptionalTensor& attn_mask = {},
                               int64_t window_left = -1, int64_t window_right = -1, double dropout_p = 0.0,
                               const OptionalTensor& dropout_seed = {}) {
  const DType dtype = check_attention(q, k, v, Impl::flash, scale, causal, block_q, block_k, attn_mask, window_left,
                                      window_right, dropout_p, dropout_seed);
  check_like(dout, "dout", q, "q");
  check_like(out, "out", q, "q");
  TORCH_CHECK_VALUE(lse.defined(), "lse must be a tensor, got None");
  TORCH_CHECK_TYPE(lse.layout() == at::kStrided, "lse must be a dense (strided) tensor, got layout ", lse.layout());
  const auto lead = q.sym_sizes().slice(0, q.dim() - 1);
  CHECK_SIZES(equal_sizes(lse.sym_sizes(), lead), "lse must have shape ", lead, " (q's without the last dim); got ",
              lse.sym_sizes());
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, "lse must be float32, got ", lse.scalar_type());
  check_devices({{"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}});
  return dtype;
}

// Asked once: sysconf(_SC_PHYS_PAGES) is a system call (sysinfo), a few µs that every call would otherwise pay
// for each output and workspace it checks.
int64_t physical_memory_bytes() {
  static const int64_t bytes = [] {
    const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size : INT64_MAX;
  }();
  return bytes;
}

// Sizes arithmetic that says when it leaves int64: -1 then (sizes are never negative, so -1 propagates).
int64_t checked_product(at::IntArrayRef factors) {
  int64_t product = 1;
  for (const int64_t f : factors)
    if (f < 0 || __builtin_mul_overflow(product, f, &product)) return -1;
  return product;
}
int64_t checked_sum(at::IntArrayRef terms) {
  int64_t sum = 0;
  for (const int64_t t : terms)
    if (t < 0 || __builtin_add_overflow(sum, t, &sum)) return -1;
  return sum;
}

std::string gib(double bytes) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1) << bytes / (1 << 30);
  return s.str();
}

// Refuses, with torch.OutOfMemoryError naming what is allocated and its sizes, `count` elements of `elem_size`
// bytes that overflow int64 (count -1: the count itself did) or exceed this machine's memory. torch's allocator
// would raise a RuntimeError at best; a size that wrapped around would be allocated, too small, and overrun.
// `what()` says what is allocated; it is called only to word the error (formatting it costs more than the check).
template <class Describe>
void check_fits(int64_t count, int64_t elem_size, const Describe& what) {
  const int64_t bytes = checked_product({count, elem_size});
  if (bytes >= 0 && bytes <= physical_memory_bytes()) return;
  TORCH_CHECK_WITH(OutOfMemoryError, bytes >= 0, what(), " is beyond any machine's memory: its size overflows int64");
  TORCH_CHECK_WITH(OutOfMemoryError, false, what(), " needs ", gib(bytes), " GiB, more than this machine's memory (",
                   gib(physical_memory_bytes()), " GiB)");
}

std::string shape_of(const char* name, at::IntArrayRef sizes) {
  std::ostringstream s;
  s << name << " of shape " << sizes;
  return s.str();
}

// (..., N, d) as (batch, heads, N, d): a view for 2-, 3- and 4-D; leading dims beyond two are flattened
// into the batch, which is a view too whenever their strides allow it. A copy (the rare case) is checked first:
// a stride-0 expanded input of astronomically many elements takes no memory until it is copied.
at::Tensor as_4d(const at::Tensor& t, const char* name) {
  const auto copy_fits = [&] {
    check_fits(t.numel(), t.element_size(), [&] { return std::string("a copy of ") + shape_of(name, t.sizes()); });
  };
  at::Tensor t4;
  switch (t.dim()) {
    case 2: t4 = t.unsqueeze(0).unsqueeze(0); break;
    case 3: t4 = t.unsqueeze(0); break;
    case 4: t4 = t; break;
    default: {
      const auto sizes = t.sizes();
      const int64_t batch = c10::multiply_integers(sizes.begin(), sizes.end() - 3);
      const std::array<int64_t, 4> shape{batch, sizes[t.dim() - 3], sizes[t.dim() - 2], sizes[t.dim() - 1]};
      if (!at::detail::computeStride(sizes, t.strides(), shape)) copy_fits();
      t4 = t.flatten(0, t.dim() - 4);
    }
  }
  // The one copy we ever make: SIMD loads need the head_dim columns contiguous.
  if (t4.size(3) > 1 && t4.stride(3) != 1) {
    copy_fits();
    t4 = t4.contiguous();
  }
  return t4;
}

// attn_mask as (batch, heads, Nq, Nk) like q's as_4d: expanded (a view: stride 0 along the broadcast dims, never
// a copy), leading dims beyond two flattened into the batch (a view whenever the strides allow; else a copy,
// checked first, as for q).
at::Tensor mask_as_4d(const at::Tensor& mask, const at::Tensor& q, int64_t kv_len) {
  std::vector<int64_t> scores(q.sizes().begin(), q.sizes().end());
  scores.back() = kv_len;
  const at::Tensor m = mask.expand(scores);
  switch (m.dim()) {
    case 2: return m.unsqueeze(0).unsqueeze(0);
    case 3: return m.unsqueeze(0);
    case 4: return m;
    default: {
      const auto sizes = m.sizes();
      const int64_t batch = c10::multiply_integers(sizes.begin(), sizes.end() - 3);
      const std::array<int64_t, 4> shape{batch, sizes[m.dim() - 3], sizes[m.dim() - 2], sizes[m.dim() - 1]};
      if (!at::detail::computeStride(sizes, m.strides(), shape))
        check_fits(m.numel(), m.element_size(), [&] { return "a copy of " + shape_of("attn_mask", sizes); });
      return m.reshape(shape);
    }
  }
}

void fill_strides(int64_t (&strides)[3], const at::Tensor& t4) {
  for (int i = 0; i < 3; ++i) strides[i] = t4.stride(i);
}

// naive and blocked materialise the q_len × kv_len score matrix: refuse up front when it cannot fit.
void check_score_matrix_fits(int64_t q_len, int64_t kv_len, const char* impl) {
  int64_t elems = 0;
  const bool overflow = __builtin_mul_overflow(q_len, kv_len, &elems);
  TORCH_CHECK_WITH(OutOfMemoryError, !overflow && elems * static_cast<double>(sizeof(float)) <= physical_memory_bytes(),
                   "impl='", impl, "' materialises the q_len x kv_len score matrix (", q_len, " x ", kv_len,
                   " floats = ", gib(static_cast<double>(q_len) * static_cast<double>(kv_len) * sizeof(float)),
                   " GiB), more than this machine's memory; use impl='fused' or 'flash', which need O(N) memory");
}

// q, k, v checked and seen as (batch, heads, N, d), with the params of a call on them (all but out and lse).
struct Prepared {
  at::Tensor q4, k4, v4;  // views (or, for a strided last dim, copies) that the params point into
  at::Tensor mask4;       // attn_mask expanded to (batch, heads, Nq, Nk): a view, stride 0 where broadcast
  at::Tensor key_ranges;  // attn_mask's runs of shown keys, when each row has one (key_ranges_of)
  AttentionParams p;
};

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
// the mask, but only inside the runs, skipping the keys a run hides unread, where the mask alone has to be read to
// each row's end to find them. That pays only where the kernels read each mask row several times (a bias shared by
// the batch, or by the heads): this scan reads every row once more. On the device host (results/ab_s19d_masks.txt,
// (B, 12, 1024, 64) with a causal ALiBi bias, two rounds) a (1, 12, N, N) bias over a batch of 4 went from 53.5 to
// 37–50 ms in bf16 on one thread and 4.3–4.7 to 3.1–3.9 ms on 16 (float32 109–133 → 89–93 and 9.3–9.7 → 7.4–7.6);
// read once a row (batch 1, or a bias per batch element) it lost, 1.2–1.4 → 1.8–2.0 ms on 16 threads. So a bias is
// taken only where each row serves kMinBiasReuse (batch, head) pairs or more; a mask whose first look hides no key at
// all (a few rows each one run over every key: a T5 encoder's bias) is left unscanned, since its runs would skip
// nothing.
constexpr int64_t kMinBiasReuse = 4;
struct KeyRanges {
  at::Tensor ranges;
  bool plain = true;
};
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
  const bool bias_pays = mask4.size(0) * mask4.size(1) >= kMinBiasReuse * extent[0] * extent[1];
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

// float32's products on AMX (AttentionParams::f32_products): set_float32_products() chooses; automatic is float32
// FMAs (flash_bf16.cpp, takes_float32, has the measurements).
F32Products g_float32_products = F32Products::automatic;

// Fills the params of a call whose arguments check_attention has passed (it returned dtype).
Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Impl impl, DType dtype,
                 std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                 std::optional<int64_t> block_k, const OptionalTensor& attn_mask = {}, int64_t window_left = -1,
                 int64_t window_right = -1, double dropout_p = 0.0, const OptionalTensor& dropout_seed = {}) {
  // Meta tensors pass check_attention (the fake implementations share it); the kernels need memory.
  TORCH_CHECK_VALUE(q.device().is_cpu(), "q must be on the CPU, got a tensor on ", q.device());
  const int64_t d = q.size(-1), q_len = q.size(-2), kv_len = k.size(-2);
  const double scale_value = scale.value_or(1.0 / std::sqrt(static_cast<double>(d)));

  Prepared prep{as_4d(q, "q"), as_4d(k, "k"), as_4d(v, "v"), {}, {}};
  AttentionParams& p = prep.p;
  p.q = prep.q4.data_ptr();
  p.k = prep.k4.data_ptr();
  p.v = prep.v4.data_ptr();
  p.dtype = dtype;
  fill_strides(p.q_strides, prep.q4);
  fill_strides(p.k_strides, prep.k4);
  fill_strides(p.v_strides, prep.v4);
  p.batch = prep.q4.size(0);
  p.num_heads = prep.q4.size(1);
  p.num_kv_heads = prep.k4.size(1);
  p.q_len = q_len;
  p.kv_len = kv_len;
  p.head_dim = d;
  p.scale = static_cast<float>(scale_value);
  p.causal_offset = parse_causal(causal, q_len, kv_len, &p.is_causal);
  p.num_threads = std::max(1, at::get_num_threads());
  p.f32_products = g_float32_products;
  if (is_given(attn_mask)) {
    prep.mask4 = mask_as_4d(*attn_mask, q, kv_len);
    p.mask = prep.mask4.data_ptr();
    const at::ScalarType mt = attn_mask->scalar_type();
    p.mask_kind = mt == at::kBool ? MaskKind::boolean : MaskKind::additive;
    p.mask_dtype = mt == at::kBFloat16 ? DType::bf16 : mt == at::kHalf ? DType::f16 : DType::f32;
    for (int i = 0; i < 4; ++i) p.mask_strides[i] = prep.mask4.stride(i);
    // One run of shown keys per row (the masks of padded batches, boolean or 0/−inf; or a bias under them): the
    // kernels take the runs instead of the mask, or beside it where the runs add a bias.
    KeyRanges runs;
    if (impl == Impl::flash && prep.mask4.numel() > 0) runs = key_ranges_of(prep.mask4);
    if (runs.ranges.defined()) {
      prep.key_ranges = runs.ranges;
      p.key_ranges = prep.key_ranges.data_ptr<int64_t>();
      for (int d = 0; d < 3; ++d) p.key_range_strides[d] = prep.key_ranges.size(d) == 1 ? 0 : prep.key_ranges.stride(d);
      if (runs.plain) {
        p.mask = nullptr;
        p.mask_kind = MaskKind::none;
      }
    }
  }
  // A bound that reaches past every key leaves its side unbounded (−1): row i's band is i + offset ± bound in int64
  // (attention.h), which a bound near INT64_MAX — sys.maxsize meaning "no bound" — would overflow. Exact: with
  // |offset| < q_len + kv_len, a bound beyond q_len + kv_len hides no key.
  const auto bound_or_none = [&](int64_t bound) { return bound > q_len + kv_len ? int64_t{-1} : bound; };
  p.window_left = bound_or_none(window_left);
  p.window_right = bound_or_none(window_right);
  p.window_offset = kv_len - q_len;
  if (dropout_p > 0.0) {
    p.dropout_p = static_cast<float>(dropout_p);
    const at::Tensor seed = dropout_seed->contiguous();
    p.dropout_seed = static_cast<uint64_t>(seed.data_ptr<int64_t>()[0]);
    p.dropout_offset = static_cast<uint64_t>(seed.data_ptr<int64_t>()[1]);
  }
  switch (impl) {
    case Impl::naive:
    case Impl::fused:
      break;
    case Impl::blocked:
      // blocked has one tile size, for both matrix multiplies: block_q, or else block_k. A tile larger than
      // every dimension is the whole matrix.
      p.block_q = p.block_k = std::min(block_q.value_or(block_k.value_or(kDefaultBlockedTile)),
                                       std::max({q_len, kv_len, d}));
      break;
    case Impl::flash:
      // 0 lets the kernel choose its tiles (flash.cpp). Given tiles are clamped to the sequence lengths here,
      // before any kernel rounds them up to row groups or vectors: a tile beyond N is all of N (the forward
      // clamps it too; the backward's round_up(block_q, ...) would overflow near INT64_MAX).
      p.block_q = block_q ? std::min(*block_q, q_len) : 0;
      p.block_k = block_k ? std::min(*block_k, kv_len) : 0;
      break;
  }
  return prep;
}

// An upper bound, in floats, of every kernel's workspace formula (-1: beyond int64). The kernels size their
// workspace in plain int64 arithmetic, rounding tiles up to row groups and vectors (never more than 64 elements);
// for sizes that are huge while the memory behind them is not (stride-0 expanded inputs) that arithmetic would wrap
// around and hand the kernel a buffer far too small. With Q = B·H·(Nq+64)·(d+64), K = B·H·(Nk+64)·(d+64) and
// T = threads·(Nq+Nk+128)·(d+64), flash_backward.cpp's formula is below 6·Q + 8·K + 6·T; the one-pass backward
// kernels' below 9·Q + 32·T (up to 8 key chunks' partial dQ, tiles of at most 512 × 512); flash.cpp's
// below 19·K + 27·T (Bc = 1 pads every key to a vector); flash_decode.cpp's below 64·Q + 2·T (at most 64 splits of
// a row); fused.cpp's below T; naive and blocked's is Nq·Nk. So while 64·(Q + K + T) + Nq·Nk fits, none of the
// kernels' formulas overflows.
int64_t workspace_bound_floats(const AttentionParams& p) {
  constexpr int64_t kPad = 64, kSlack = 64;
  const int64_t heads_d = checked_product({p.batch, p.num_heads, checked_sum({p.head_dim, kPad})});  // Hkv ≤ H
  const int64_t queries = checked_product({heads_d, checked_sum({p.q_len, kPad})});
  const int64_t keys = checked_product({heads_d, checked_sum({p.kv_len, kPad})});
  const int64_t per_thread = checked_product(
      {p.num_threads, checked_sum({p.q_len, p.kv_len, 2 * kPad}), checked_sum({p.head_dim, kPad})});
  const int64_t scores = checked_product({p.q_len, p.kv_len});
  return checked_sum({checked_product({kSlack, checked_sum({queries, keys, per_thread})}), scores});
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
// the model's other tensors — fault their pages in again. On the device host, BERT (32 × 128, float32, 16
// threads) took 45,700 page faults a forward with our attention against 22,500 with torch's, our call 4.5 ms in the
// model against 1.5 alone, and the model ran at 0.65× (results/s8d_bfloat16_probe_bert.txt, s8e_float32_models.txt);
// a fresh mapping per call instead zeroed its pages every call (s8f: bf16 0.77×). Kept, the pages are faulted in
// once. (From 64 KB since session 16, not 4 MB: BERT's 128-token calls, whose tasks now pack their own key tiles,
// need ~2 MB on 16 threads where all of K packed took 10.) The profiler is told of the workspace as torch's
// allocator tells it of its own, allocated at the start of each call and freed at its end (memory events), so
// peak-memory measurements count it where it is used; the mapping itself stays until the thread ends (at most
// 64 MB; a larger workspace, or one asked for while the kept one is in use, gets a mapping of its own for the
// call). Undefined if the system refuses.
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

// An output of these sizes (the kernels write every element), checked before it is allocated.
at::Tensor checked_empty(at::IntArrayRef sizes, const at::TensorOptions& options, const char* name) {
  check_fits(checked_product(sizes),
             static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype()))),
             [&] { return shape_of(name, sizes); });
  return at::empty(sizes, options);
}

// The decode kernel, under a profiler label of its own ("cs149gpt::flash_decode", inside the operator's event):
// which CPU kernel a call ran is then visible (tests check that masked decoding takes it). Costs a flag test when
// no profiler is on.
void run_decode_kernel(const AttentionParams& p, float* workspace) {
  RECORD_FUNCTION("cs149gpt::flash_decode", c10::ArrayRef<const c10::IValue>{});
  kernels().decode.run(p, workspace);
}

// The gradient of t (q, k or v), laid out like torch's CPU attention lays its gradients: (..., N, H, d) in memory when
// t keeps its heads inside its tokens (a model's (B, N, H·d) projection viewed as (B, H, N, d): t's head stride below
// its row stride), contiguous otherwise. The autograd of those views (transpose, select) then takes the gradient with a
// dense copy instead of a strided one. The fake (ops.py, _grad_like) decides the same from the same sizes and strides.
bool heads_inside_tokens(const at::Tensor& t) {
  const int64_t n = t.dim();
  return n >= 3 && t.size(n - 3) > 1 && t.size(n - 2) > 1 && t.stride(n - 3) < t.stride(n - 2);
}

at::Tensor empty_grad_like(const at::Tensor& t, const char* name) {
  if (!heads_inside_tokens(t)) return checked_empty(t.sizes(), t.options(), name);
  const int64_t n = t.dim();
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  std::swap(sizes[n - 3], sizes[n - 2]);
  return checked_empty(sizes, t.options(), name).transpose(n - 3, n - 2);
}

// The output of query q, laid out as torch's CPU attention lays it: dense, in q's order of strides (empty_like): a
// model that viewed its (B, N, H·d) projection as (B, H, N, d) gets (B, N, H, d) memory back, and its
// out.transpose(1, 2).contiguous() is free. Contiguous for q of more than 4 dims, whose leading dims the kernels see
// flattened into one (as_4d), which a permuted order would not allow, and where q's head_dim is not its innermost
// dim: the kernels write rows of whole vectors. The fake (ops.py, _out_like) does the same.
at::Tensor empty_out_like(const at::Tensor& q) {
  check_fits(q.numel(), q.element_size(), [&] { return shape_of("out", q.sizes()); });
  if (q.dim() <= 4) {
    at::Tensor out = at::empty_like(q, at::MemoryFormat::Preserve);
    if (out.stride(-1) == 1) return out;
  }
  return at::empty(q.sizes(), q.options());
}

// Runs one forward kernel. Returns (out, lse); lse is defined only when asked for (flash only).
std::tuple<at::Tensor, at::Tensor> run_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 Impl impl, std::optional<double> scale, const std::string& causal,
                                                 std::optional<int64_t> block_q, std::optional<int64_t> block_k,
                                                 bool want_lse, const OptionalTensor& attn_mask = {},
                                                 int64_t window_left = -1, int64_t window_right = -1,
                                                 double dropout_p = 0.0, const OptionalTensor& dropout_seed = {}) {
  TORCH_CHECK_VALUE(!want_lse || impl == Impl::flash, "lse is computed by impl='flash' only");
  const DType dtype = check_attention(q, k, v, impl, scale, causal, block_q, block_k, attn_mask, window_left,
                                      window_right, dropout_p, dropout_seed);
  Prepared prep = prepare(q, k, v, impl, dtype, scale, causal, block_q, block_k, attn_mask, window_left, window_right,
                          dropout_p, dropout_seed);
  AttentionParams& p = prep.p;
  const KernelTable& kernels = cs149gpt::kernels();
  const Kernel* kernel = nullptr;
  switch (impl) {
    case Impl::naive:
      check_score_matrix_fits(p.q_len, p.kv_len, "naive");
      kernel = &kernels.naive;
      break;
    case Impl::blocked:
      check_score_matrix_fits(p.q_len, p.kv_len, "blocked");
      kernel = &kernels.blocked;
      break;
    case Impl::fused: kernel = &kernels.fused; break;
    // A few query rows (decoding) go to flash-decoding, which splits the keys instead (attention.h), attn_mask and
    // window included; the tiled kernels take the rest.
    case Impl::flash: kernel = decode_kernel_takes(p) ? &kernels.decode : &kernels.flash; break;
  }
  const at::Tensor out = empty_out_like(q), out4 = as_4d(out, "out");
  p.out = out4.data_ptr();
  fill_strides(p.out_strides, out4);
  at::Tensor lse;
  if (want_lse) {
    lse = checked_empty({p.batch, p.num_heads, p.q_len}, q.options().dtype(at::kFloat), "lse");
    p.lse = lse.data_ptr<float>();
    p.lse_strides[0] = lse.stride(0);
    p.lse_strides[1] = lse.stride(1);
  }

  if (p.batch * p.num_heads > 0) {
    const at::Tensor ws = workspace(*kernel, p, p, std::string("the workspace of impl='") + impl_name(impl) + "'");
    if (kernel == &kernels.decode)
      run_decode_kernel(p, ws.data_ptr<float>());
    else
      kernel->run(p, ws.data_ptr<float>());
  }
  const auto lead = q.sizes().slice(0, q.dim() - 1);
  return {out, want_lse ? lse.view(lead) : lse};
}

}  // namespace

// attention(q, k, v, impl, scale, causal, block_q, block_k) -> out
//   q: (..., Nq, d); k, v: (..., Nk, d) with the same leading dims, except that the head dim (-3) of k and v
//   may divide q's (grouped-query attention). out: (..., Nq, d), q's dtype, laid out as torch's (empty_out_like).
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& impl,
                     std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                     std::optional<int64_t> block_k) {
  return std::get<0>(run_attention(q, k, v, parse_impl(impl), scale, causal, block_q, block_k, false));
}

// flash_attention(q, k, v, scale, causal, block_q, block_k, attn_mask) -> (out, lse)
//   lse: (..., Nq) float32, the logsumexp of each query row's scaled, masked logits (−inf for a row that
//   sees no key). The backward pass recomputes P from it. attn_mask: torch SDPA's (bool or additive, any shape
//   broadcastable to (..., Nq, Nk)), applied together with the causal mask. window_left, window_right: the sliding
//   window (FlashAttention's window_size, -1 = unbounded), applied with both. dropout_p > 0: dropout on the
//   attention weights, its mask generated from dropout_seed = (seed, offset), int64 (attention.h: dropout_keep).
std::tuple<at::Tensor, at::Tensor> flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   std::optional<double> scale, const std::string& causal,
                                                   std::optional<int64_t> block_q, std::optional<int64_t> block_k,
                                                   const OptionalTensor& attn_mask, int64_t window_left,
                                                   int64_t window_right, double dropout_p,
                                                   const OptionalTensor& dropout_seed) {
  return run_attention(q, k, v, Impl::flash, scale, causal, block_q, block_k, true, attn_mask, window_left,
                       window_right, dropout_p, dropout_seed);
}

// The flash backward's algorithm for these params. One pass (flash_backward_onepass.cpp, flash_backward_bf16.cpp:
// five tile products, a task per (batch, kv head) owning its gradient rows; split into key_chunks runs of key tiles
// when there are too few of them for the CPUs (float32: fewer than kTasksPerCpu a CPU), the runs' dQ summed in run
// order; float32 also splits a group's query heads into head_parts, for MQA-like groups on few kv heads, whose dK, dV
// shares are summed in part order) when its tasks keep at least kOnePassMinBusy (bf16 on dot-product hardware: kOnePassMinBusyBf16Dot) of this
// machine's CPUs busy; two passes (seven products, tasks per tile) otherwise.
// Decided from the shape and the machine's CPU count, never the call's thread count, so that the gradients' bits do
// not depend on it. set_backward_path() / set_backward_key_chunks() / set_backward_head_parts() force them (tests
// run every path).
constexpr double kOnePassMinBusy = 0.6;  // the one-pass kernel measured ~1.6x the two-pass one's speed per thread
// bf16 where the ISA has bf16 dot-product hardware: the one-pass kernel multiplies on it (flash_backward_bf16.cpp),
// the two-pass one converts to float32 FMAs. Gemma-2B's heads (8 query, 1 kv, d = 256, 1024 keys, causal: 8 key runs,
// half of the device host's 16 CPUs), backward ×SDPA (results/s15b_backward_paths_bf16.txt): one pass 1.45 on one
// thread where two passes ran 0.26, and 1.87 against 2.01 on 16 threads. So from a quarter of the CPUs busy.
constexpr double kOnePassMinBusyBf16Dot = 0.25;
constexpr double kKeyChunksBusy = 0.85;  // split a kv head's keys until this many of the CPUs are busy
constexpr int64_t kMaxKeyChunks = 8, kMinKeysPerChunk = 128;
std::string g_backward_path = "auto";
int64_t g_backward_key_chunks = 0;  // 0: decided by shape
int64_t g_backward_head_parts = 0;  // 0: decided by shape

int64_t machine_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN));
}

// The share of `cpus` that `tasks` equal tasks keep busy over the rounds they take.
double busy_share(int64_t tasks, int64_t cpus) {
  const int64_t rounds = (tasks + cpus - 1) / cpus;
  return static_cast<double>(tasks) / static_cast<double>(rounds * cpus);
}

// The float32 one-pass kernel merges each run's dQ into the kv head's sum (in dq itself) as the run ends, so runs
// cost no memory, and more tasks than CPUs pay: with one task per CPU the call waits for the slowest CPU. Device
// host, 16 threads, float32 backward ×SDPA (results/s9d_backward_tasks_t16.txt, s9e_backward_tasks_t16.txt):
// (1,16,4096,128) 1.13 with 16 tasks, 1.08-1.30 with 32, 1.29-1.32 with 64; (4,12,2048,64) 1.51 with 48, 1.55-1.66
// with 96. So float32 splits until kTasksPerCpu tasks per CPU.
constexpr int64_t kTasksPerCpu = 4;

void choose_backward(AttentionBackwardParams& bp) {
  const AttentionParams& p = bp.fwd;
  const int64_t pairs = p.batch * p.num_kv_heads, cpus = machine_cpus();
  const int64_t most_chunks = std::clamp<int64_t>(p.kv_len / kMinKeysPerChunk, 1, kMaxKeyChunks);
  int64_t chunks = 1;
  if (p.dtype == DType::f32) {
    while (chunks * 2 <= most_chunks && pairs * chunks < kTasksPerCpu * cpus) chunks *= 2;
  } else {
    while (chunks * 2 <= most_chunks && busy_share(pairs * chunks, cpus) < kKeyChunksBusy) chunks *= 2;
  }
  if (g_backward_key_chunks > 0) chunks = g_backward_key_chunks;
  bp.key_chunks = chunks;
  // float32, still too few tasks: the group's query heads in parts too (halving while the group divides). Gemma-2B's
  // 8 query heads on 1 kv head, 1024 keys: 8 runs × 8 parts, where 8 runs alone kept half of 16 CPUs busy and took
  // two passes (0.77× SDPA forward + backward on one thread, results/s15a_sweep_backward.txt).
  int64_t parts = 1;
  if (p.dtype == DType::f32) {
    const int64_t group = p.num_heads / p.num_kv_heads;
    while (group % (parts * 2) == 0 && pairs * chunks * parts < kTasksPerCpu * cpus) parts *= 2;
  }
  if (g_backward_head_parts > 0) parts = g_backward_head_parts;
  bp.head_parts = parts;
  const int64_t tasks = pairs * chunks * (p.dtype == DType::f32 ? std::gcd(parts, p.num_heads / p.num_kv_heads) : 1);
  const bool bf16_dot = p.dtype == DType::bf16 && kernels().bf16_dot_probe != nullptr;
  if (g_backward_path != "auto")
    bp.path = g_backward_path == "one_pass" ? BackwardPath::one_pass : BackwardPath::two_pass;
  else
    bp.path = busy_share(tasks, cpus) >= (bf16_dot ? kOnePassMinBusyBf16Dot : kOnePassMinBusy)
                  ? BackwardPath::one_pass : BackwardPath::two_pass;
}


// flash_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k) -> (dq, dk, dv)
//   The gradients of flash_attention's out with respect to q, k, v, given dout = ∂L/∂out and the forward's
//   out and lse; P is recomputed tile by tile from lse (flash_backward.cpp). dk, dv have k's and v's shape.
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
    std::optional<int64_t> block_k, const OptionalTensor& attn_mask, int64_t window_left, int64_t window_right,
    double dropout_p, const OptionalTensor& dropout_seed) {
  const DType dtype = check_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k, attn_mask,
                                               window_left, window_right, dropout_p, dropout_seed);
  Prepared prep = prepare(q, k, v, Impl::flash, dtype, scale, causal, block_q, block_k, attn_mask, window_left,
                          window_right, dropout_p, dropout_seed);

  AttentionBackwardParams bp;
  bp.fwd = prep.p;
  choose_backward(bp);
  const at::Tensor dq = empty_grad_like(q, "dq"), dk = empty_grad_like(k, "dk"), dv = empty_grad_like(v, "dv");
  const at::Tensor dq4 = as_4d(dq, "dq"), dk4 = as_4d(dk, "dk"), dv4 = as_4d(dv, "dv");  // views
  const at::Tensor dout4 = as_4d(dout, "dout"), out4 = as_4d(out, "out");
  const at::Tensor lse3 = lse.reshape({bp.fwd.batch, bp.fwd.num_heads, bp.fwd.q_len}).contiguous();
  bp.fwd.out = out4.data_ptr();
  fill_strides(bp.fwd.out_strides, out4);
  bp.fwd.lse = const_cast<float*>(lse3.data_ptr<float>());
  bp.fwd.lse_strides[0] = lse3.stride(0);
  bp.fwd.lse_strides[1] = lse3.stride(1);
  bp.dout = dout4.data_ptr();
  fill_strides(bp.dout_strides, dout4);
  bp.dq = dq4.data_ptr();
  bp.dk = dk4.data_ptr();
  bp.dv = dv4.data_ptr();
  fill_strides(bp.dq_strides, dq4);
  fill_strides(bp.dk_strides, dk4);
  fill_strides(bp.dv_strides, dv4);
  if (bp.fwd.batch * bp.fwd.num_heads > 0) {
    const BackwardKernel& kernel = kernels().flash_backward;
    kernel.run(bp, workspace(kernel, bp, bp.fwd, "the workspace of the flash backward").data_ptr<float>());
  }
  return {dq, dk, dv};
}

namespace {

// ---------------------------------------------------------------------------------------------------
// attention_with_kvcache: new queries against a KV cache, contiguous or paged, with optional new keys/values
// appended in place first. The checks on sizes (symbolic: the fake implementation calls this too), then the
// checks on the data (lengths, block ids: read here, before the kernel, so no index can leave the cache).
// ---------------------------------------------------------------------------------------------------
void check_dense(const at::Tensor& t, const char* name, int64_t dims, const char* shape) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided && !t.is_nested(), name, " must be a dense (strided) tensor");
  TORCH_CHECK_TYPE(!t.is_quantized(), name, " must not be quantized; got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dims, name, " must have shape ", shape, "; got ", t.sym_sizes());
}

// Returns the dtype of the call.
DType check_kvcache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                    const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
                    std::optional<double> scale) {
  const bool paged = block_table.has_value() && block_table->defined();
  const char* cache_shape = paged ? "(num_blocks, Hkv, block_size, d) (a paged cache: block_table is given)"
                                  : "(B, Hkv, max_len, d)";
  check_dense(q, "q", 4, "(B, Hq, Nq, d)");
  check_dense(k_cache, "k_cache", 4, cache_shape);
  check_dense(v_cache, "v_cache", 4, cache_shape);
  check_dense(cache_seqlens, "cache_seqlens", 1, "(B,)");
  const bool has_k_new = k_new.has_value() && k_new->defined(), has_v_new = v_new.has_value() && v_new->defined();
  TORCH_CHECK_VALUE(has_k_new == has_v_new, "k_new and v_new must be given together, got ",
                    has_k_new ? "k_new without v_new" : "v_new without k_new");
  if (has_k_new) {
    check_dense(*k_new, "k_new", 4, "(B, Hkv, Nq, d)");
    check_dense(*v_new, "v_new", 4, "(B, Hkv, Nq, d)");
  }
  if (paged) check_dense(*block_table, "block_table", 2, "(B, max_blocks)");

  // One device: the CPU (or meta, for tracing).
  std::vector<std::pair<const char*, const at::Tensor*>> all = {
      {"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"cache_seqlens", &cache_seqlens}};
  if (has_k_new) {
    all.push_back({"k_new", &*k_new});
    all.push_back({"v_new", &*v_new});
  }
  if (paged) all.push_back({"block_table", &*block_table});
  for (const auto& [name, t] : all) {
    TORCH_CHECK_VALUE(t->device().is_cpu() || t->device().is_meta(), "attention_with_kvcache runs on the CPU: ", name,
                      " is on ", t->device());
    TORCH_CHECK_VALUE(t->device() == q.device(), "q and ", name, " must be on one device, got q on ", q.device(), ", ",
                      name, " on ", t->device());
  }

  const DType dtype = parse_dtype(q, Impl::flash);
  for (const auto& [name, t] : all) {
    if (t == &cache_seqlens || (paged && t == &*block_table)) continue;
    TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type(), name, " must have q's dtype, ", q.scalar_type(), "; got ",
                     t->scalar_type());
  }
  TORCH_CHECK_TYPE(cache_seqlens.scalar_type() == at::kInt || cache_seqlens.scalar_type() == at::kLong,
                   "cache_seqlens must be int32 or int64, got ", cache_seqlens.scalar_type());
  if (paged)
    TORCH_CHECK_TYPE(block_table->scalar_type() == at::kInt, "block_table must be int32, got ",
                     block_table->scalar_type());

  const c10::SymInt B = q.sym_size(0), Hq = q.sym_size(1), Nq = q.sym_size(2), d = q.sym_size(3);
  const c10::SymInt Hkv = k_cache.sym_size(1);
  CHECK_SIZES(d.sym_ge(1), "head dim d (the last dim of q) must be >= 1, got q of shape ", q.sym_sizes());
  CHECK_SIZES(Nq.sym_ge(1), "q must have at least one query row (dim 2), got shape ", q.sym_sizes());
  CHECK_SIZES(equal_sizes(v_cache.sym_sizes(), k_cache.sym_sizes()), "v_cache must have k_cache's shape ",
              k_cache.sym_sizes(), "; got ", v_cache.sym_sizes());
  CHECK_SIZES(k_cache.sym_size(3).sym_eq(d), "k_cache and v_cache must have head dim d = ", d,
              " (the last dim of q), got k_cache of shape ", k_cache.sym_sizes());
  CHECK_SIZES(Hkv.sym_ge(1), "k_cache must have at least one kv head (dim 1), got k_cache of shape ",
              k_cache.sym_sizes());
  CHECK_SIZES((Hq % Hkv).sym_eq(0),
              "the heads of q (dim 1) must be a multiple of the kv heads of k_cache (dim 1), got q ", q.sym_sizes(),
              ", k_cache ", k_cache.sym_sizes());
  CHECK_SIZES(k_cache.sym_size(2).sym_ge(1), "k_cache must have room for at least one key (dim 2), got shape ",
              k_cache.sym_sizes());
  CHECK_SIZES(cache_seqlens.sym_size(0).sym_eq(B), "cache_seqlens must have shape (B,) = (", B,
              ",) (one length per sequence of q), got ", cache_seqlens.sym_sizes());
  if (paged) {
    CHECK_SIZES(block_table->sym_size(0).sym_eq(B), "block_table must have shape (B, max_blocks) with B = ", B,
                " (q's batch), got ", block_table->sym_sizes());
  } else {
    CHECK_SIZES(k_cache.sym_size(0).sym_eq(B), "k_cache must have shape (B, Hkv, max_len, d) with B = ", B,
                " (q's batch), got ", k_cache.sym_sizes(), " (a paged cache needs block_table)");
  }
  if (has_k_new) {
    const std::vector<c10::SymInt> expected = {B, Hkv, Nq, d};
    for (const auto& [name, t] : {std::pair{"k_new", &*k_new}, std::pair{"v_new", &*v_new}})
      CHECK_SIZES(equal_sizes(t->sym_sizes(), expected), name, " must have shape (B, Hkv, Nq, d) = ",
                  c10::SymIntArrayRef(expected), ", got ", t->sym_sizes());
  }
  // The cache is written in place and read through its strides: its rows must be contiguous (no copy can stand
  // in for it); written into, no two of its elements may share memory (an expanded cache: one head's new row would
  // overwrite another's), as torch refuses for its in-place ops.
  for (const auto& [name, t] : {std::pair{"k_cache", &k_cache}, std::pair{"v_cache", &v_cache}}) {
    CHECK_SIZES(t->sym_size(3).sym_eq(1).sym_or(t->sym_stride(3).sym_eq(1)), name,
                " must have a contiguous last dim (stride 1), got strides ", t->sym_strides());
    if (has_k_new)
      TORCH_CHECK_VALUE(at::has_internal_overlap(*t) != at::MemOverlap::Yes, name,
                        " has elements that share memory (an expanded view: strides ", t->sym_strides(),
                        "), so k_new and v_new cannot be written into it; pass a cache of its own (.contiguous())");
  }
  if (scale)
    TORCH_CHECK_VALUE(std::isfinite(*scale) && std::fabs(*scale) < kFloat32Overflow,
                      "scale must be a finite float32, got ", *scale);
  return dtype;
}

// Appending into a paged cache: each row that k_new and v_new are written to must be seen by the sequence that writes
// it, and by no other. Block tables may share a block (a common prefix), but a row that one sequence appends and
// another sees (or appends too) would give that other sequence a key that is not its own; so would a table naming
// one block twice, the appended row then seen at a second position. lengths[b] counts the new rows too. One more pass
// over the block ids the call reads (as the bounds check does), with a mark per cache block (kept from call to call,
// cleared after each): with the bounds check, 0.4 % of a 64-sequence paged decode's time (dev box, perf).
void check_appended_rows_unshared(const int32_t* table, int64_t max_blocks, const std::vector<int64_t>& lengths,
                                  int64_t added, int64_t page_size, int64_t num_pages) {
  thread_local std::vector<uint8_t> marks;
  if (static_cast<int64_t>(marks.size()) < num_pages) marks.resize(num_pages, 0);
  uint8_t* written = marks.data();  // written[block]: some sequence appends into it (one thread-local lookup)
  const int64_t B = static_cast<int64_t>(lengths.size());
  std::vector<int32_t> blocks;  // the blocks marked, to clear
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = (lengths[b] - added) / page_size; i * page_size < lengths[b]; ++i) {
      const int32_t block = table[b * max_blocks + i];
      if (!written[block]) blocks.push_back(block);
      written[block] = 1;
    }
  // Every (sequence, position in its table) that names a block written into: the rows of it the sequence sees,
  // [0, seen), and those it writes, [first_new, seen) (first_new = seen when it writes none there).
  struct Use {
    int32_t block;
    int64_t b, i, seen, first_new;
  };
  std::vector<Use> uses;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i * page_size < lengths[b]; ++i) {
      const int32_t block = table[b * max_blocks + i];
      if (!written[block]) continue;
      const int64_t seen = std::min(page_size, lengths[b] - i * page_size);
      const int64_t first_new = std::clamp(lengths[b] - added - i * page_size, int64_t{0}, seen);
      uses.push_back({block, b, i, seen, first_new});
    }
  for (const int32_t block : blocks) written[block] = 0;
  std::sort(uses.begin(), uses.end(), [](const Use& x, const Use& y) {  // by block, then in table order
    return std::tie(x.block, x.b, x.i) < std::tie(y.block, y.b, y.i);
  });
  for (size_t first = 0, last; first < uses.size(); first = last) {  // the uses of one block: [first, last)
    for (last = first; last < uses.size() && uses[last].block == uses[first].block;) ++last;
    for (size_t w = first; w < last; ++w)
      for (size_t u = first; u < last; ++u) {
        const Use &writer = uses[w], &other = uses[u];
        if (u == w || writer.first_new == writer.seen || other.seen <= writer.first_new) continue;
        TORCH_CHECK_VALUE(false, "block_table: sequence ", writer.b, " writes k_new and v_new into rows ",
                          writer.first_new, "..", writer.seen - 1, " of block ", writer.block, ", which block_table[",
                          other.b, ", ", other.i, "] names too, its rows 0..", other.seen - 1, " read by sequence ",
                          other.b, "; a row a call appends may be seen by the sequence that appends it alone");
      }
  }
}

}  // namespace

// attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale, is_causal) -> out
//   Sequence b holds cache_seqlens[b] keys; k_new, v_new (B, Hkv, Nq, d), when given, are written at rows
//   [cache_seqlens[b], cache_seqlens[b] + Nq) first, and then seen too. Causal: bottom-right (query i of Nq sees
//   keys j <= L_b − Nq + i). out: (B, Hq, Nq, d), contiguous, q's dtype.
at::Tensor attention_with_kvcache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                                  const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
                                  std::optional<double> scale, bool is_causal) {
  const DType dtype = check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale);
  TORCH_CHECK_VALUE(q.device().is_cpu(), "q must be on the CPU, got a tensor on ", q.device());
  const bool paged = block_table.has_value() && block_table->defined();
  const bool append = k_new.has_value() && k_new->defined();
  // Appending writes both caches: one memory for the two would take v_new over k_new (fake tensors have no memory
  // to compare, so this check is the real call's alone).
  if (append) {
    const at::MemOverlapStatus overlap = at::get_overlap_status(k_cache, v_cache);
    TORCH_CHECK_VALUE(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
                      "k_cache and v_cache share memory, so k_new and v_new would be written over each other; pass "
                      "two caches");
  }
  const int64_t B = q.size(0), Nq = q.size(2), d = q.size(3);

  // The lengths and the block ids, read before any kernel: nothing past the cache is ever touched.
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const at::Tensor table = paged ? block_table->contiguous() : at::Tensor();
  const int64_t page_size = k_cache.size(2), num_pages = k_cache.size(0);
  const int64_t max_blocks = paged ? table.size(1) : 0;
  const int64_t capacity = paged ? checked_product({max_blocks, page_size}) : k_cache.size(2);
  const int64_t added = append ? Nq : 0;
  int64_t max_len = 0;
  std::vector<int64_t> lengths(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t cached = seqlens.scalar_type() == at::kLong ? seqlens.data_ptr<int64_t>()[b]
                                                              : seqlens.data_ptr<int32_t>()[b];
    TORCH_CHECK_VALUE(cached >= 0, "cache_seqlens[", b, "] must be >= 0, got ", cached);
    TORCH_CHECK_VALUE(cached <= (capacity < 0 ? INT64_MAX : capacity) - added, "cache_seqlens[", b, "] = ", cached,
                      append ? " plus the Nq = " + std::to_string(Nq) + " new keys" : std::string(),
                      " exceed the cache's capacity of ", capacity, " keys",
                      paged ? " (max_blocks x block_size): block_table's row " + std::to_string(b) +
                                  " maps too few blocks for them"
                            : std::string(" (k_cache dim 2)"));
    const int64_t length = cached + added;
    max_len = std::max(max_len, length);
    lengths[b] = length;
    if (paged) {
      const int32_t* row = table.data_ptr<int32_t>() + b * max_blocks;
      for (int64_t i = 0; i < (length + page_size - 1) / page_size; ++i)
        TORCH_CHECK_INDEX(row[i] >= 0 && row[i] < num_pages, "block_table[", b, ", ", i, "] = ", row[i],
                          " is not a block of the cache (k_cache has ", num_pages, " blocks)");
    }
  }
  if (paged && append) check_appended_rows_unshared(table.data_ptr<int32_t>(), max_blocks, lengths, added, page_size, num_pages);

  const at::Tensor q4 = q.size(3) > 1 && q.stride(3) != 1 ? q.contiguous() : q;
  at::Tensor k_new4, v_new4;
  AttentionParams p;
  p.q = q4.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.dtype = dtype;
  fill_strides(p.q_strides, q4);
  fill_strides(p.k_strides, k_cache);
  fill_strides(p.v_strides, v_cache);
  p.batch = B;
  p.num_heads = q.size(1);
  p.num_kv_heads = k_cache.size(1);
  p.q_len = Nq;
  p.kv_len = max_len;
  p.head_dim = d;
  p.scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(d))));
  p.is_causal = is_causal;
  p.num_threads = std::max(1, at::get_num_threads());
  p.cache_seqlens = seqlens.data_ptr();
  p.cache_seqlens_int64 = seqlens.scalar_type() == at::kLong;
  if (paged) {
    p.block_table = table.data_ptr<int32_t>();
    p.block_table_stride = max_blocks;
    p.page_size = page_size;
    p.num_pages = num_pages;
  }
  if (append) {
    k_new4 = k_new->size(3) > 1 && k_new->stride(3) != 1 ? k_new->contiguous() : *k_new;
    v_new4 = v_new->size(3) > 1 && v_new->stride(3) != 1 ? v_new->contiguous() : *v_new;
    p.k_new = k_new4.data_ptr();
    p.v_new = v_new4.data_ptr();
    fill_strides(p.k_new_strides, k_new4);
    fill_strides(p.v_new_strides, v_new4);
  }
  at::Tensor out = checked_empty({B, p.num_heads, Nq, d}, q.options(), "out");
  p.out = out.data_ptr();
  fill_strides(p.out_strides, out);
  if (B * p.num_heads > 0) {
    const Kernel& kernel = kernels().decode;
    run_decode_kernel(p, workspace(kernel, p, p, "the workspace of attention_with_kvcache").data_ptr<float>());
  }
  return out;
}

namespace {

// ---------------------------------------------------------------------------------------------------
// The entry points of Stanford CS149's assignment 4, with its signatures and its math: scale 1, no mask.
// Q, K, V are (B, H, N, d); the integers must agree with them. Scratch tensors are accepted and ignored:
// our kernels keep their own scratch.
// ---------------------------------------------------------------------------------------------------
void check_bhnd(const at::Tensor& t, const char* name, int64_t B, int64_t H, int64_t N, int64_t d) {
  TORCH_CHECK_VALUE(t.defined() && t.dim() == 4, name, " must be a 4-D tensor of shape (B, H, N, d), got ",
                    t.defined() ? t.sizes() : at::IntArrayRef{});
  TORCH_CHECK_VALUE(t.size(0) == B && t.size(1) == H && t.size(2) == N && t.size(3) == d, name,
                    " has shape ", t.sizes(), " but the arguments say (B, H, N, d) = (", B, ", ", H, ", ", N, ", ", d,
                    ")");
}

at::Tensor assignment_attention(const char* impl, const at::Tensor& Q, const at::Tensor& K, const at::Tensor& V,
                                int64_t B, int64_t H, int64_t N, int64_t d, std::optional<int64_t> block_q = {},
                                std::optional<int64_t> block_k = {}) {
  check_bhnd(Q, "Q", B, H, N, d);
  check_bhnd(K, "K", B, H, N, d);
  check_bhnd(V, "V", B, H, N, d);
  return attention(Q, K, V, impl, 1.0, "none", block_q, block_k);
}

at::Tensor myNaiveAttention(at::Tensor Q, at::Tensor K, at::Tensor V, at::Tensor /*QK_t*/, int64_t B, int64_t H,
                            int64_t N, int64_t d) {
  return assignment_attention("naive", Q, K, V, B, H, N, d);
}

at::Tensor myUnfusedAttentionBlocked(at::Tensor Q, at::Tensor K, at::Tensor V, at::Tensor /*QK_t*/, int64_t B,
                                     int64_t H, int64_t N, int64_t d) {
  return assignment_attention("blocked", Q, K, V, B, H, N, d);
}

at::Tensor myFusedAttention(at::Tensor Q, at::Tensor K, at::Tensor V, at::Tensor /*temp*/, int64_t B, int64_t H,
                            int64_t N, int64_t d) {
  return assignment_attention("fused", Q, K, V, B, H, N, d);
}

at::Tensor myFlashAttention(at::Tensor Q, at::Tensor K, at::Tensor V, at::Tensor /*Qi*/, at::Tensor /*Kj*/,
                            at::Tensor /*Vj*/, at::Tensor /*Sij*/, at::Tensor /*Pij*/, at::Tensor /*PV*/,
                            at::Tensor /*Oi*/, at::Tensor /*L*/, at::Tensor /*Li*/, at::Tensor /*Lij*/,
                            at::Tensor /*Lnew*/, int64_t Bc, int64_t Br, int64_t B, int64_t H, int64_t N, int64_t d) {
  TORCH_CHECK_VALUE(Br >= 1 && Bc >= 1, "Br and Bc must be >= 1, got Br = ", Br, ", Bc = ", Bc);
  return assignment_attention("flash", Q, K, V, B, H, N, d, Br, Bc);
}

// The flat index of tensor[x][y]... in a list of `size` elements: every product and sum is checked, so indices
// near INT64_MAX are refused rather than wrapped around onto some other element (or out of bounds).
// index = ((i0 · s1 + i1) · s2 + i2) ...; -1 when it overflows or lands past the end.
int64_t flat_index(std::initializer_list<std::pair<int64_t, int64_t>> index_and_size, size_t size) {
  int64_t flat = 0;
  for (const auto& [i, n] : index_and_size)
    if (__builtin_mul_overflow(flat, n, &flat) || __builtin_add_overflow(flat, i, &flat)) return -1;
  return flat < static_cast<int64_t>(size) ? flat : -1;
}

// tensor[x][y] of a row-major 2-D array of row length sizeX, flattened into a list.
float twoDimRead(const std::vector<float>& tensor, int64_t x, int64_t y, int64_t sizeX) {
  TORCH_CHECK_VALUE(sizeX >= 1, "sizeX must be >= 1, got ", sizeX);
  TORCH_CHECK_INDEX(x >= 0 && y >= 0 && y < sizeX, "twoDimRead index (", x, ", ", y, ") is outside rows of ", sizeX);
  const int64_t index = flat_index({{x, 1}, {y, sizeX}}, tensor.size());
  TORCH_CHECK_INDEX(index >= 0, "twoDimRead index (", x, ", ", y, ") with rows of ", sizeX,
                    " is past the end of a list of ", tensor.size());
  return tensor[index];
}

// tensor[x][y][z][b] of a row-major 4-D array of sizes (·, sizeX, sizeY, sizeZ), flattened into a list.
float fourDimRead(const std::vector<float>& tensor, int64_t x, int64_t y, int64_t z, int64_t b, int64_t sizeX,
                  int64_t sizeY, int64_t sizeZ) {
  TORCH_CHECK_VALUE(sizeX >= 1 && sizeY >= 1 && sizeZ >= 1, "sizeX, sizeY, sizeZ must be >= 1, got ", sizeX, ", ",
                    sizeY, ", ", sizeZ);
  TORCH_CHECK_INDEX(x >= 0 && y >= 0 && y < sizeX && z >= 0 && z < sizeY && b >= 0 && b < sizeZ,
                    "fourDimRead index (", x, ", ", y, ", ", z, ", ", b, ") is outside sizes (·, ", sizeX, ", ", sizeY,
                    ", ", sizeZ, ")");
  const int64_t index = flat_index({{x, 1}, {y, sizeX}, {z, sizeY}, {b, sizeZ}}, tensor.size());
  TORCH_CHECK_INDEX(index >= 0, "fourDimRead index (", x, ", ", y, ", ", z, ", ", b, ") of sizes (·, ", sizeX, ", ",
                    sizeY, ", ", sizeZ, ") is past the end of a list of ", tensor.size());
  return tensor[index];
}

std::string isa() { return kernels().isa; }

// exp of every element of a float32 tensor, by the current ISA's vectorised exp (a test hook).
at::Tensor vector_exp(const at::Tensor& x) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  at::Tensor y = x.contiguous().clone();
  kernels().exp_row(y.data_ptr<float>(), y.numel());
  return y;
}

// 2^x of every element of a float32 tensor, by the current ISA's vectorised 2^x (the float32 flash kernel's; a
// test hook).
at::Tensor vector_exp2(const at::Tensor& x) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  at::Tensor y = x.contiguous().clone();
  kernels().exp2_row(y.data_ptr<float>(), y.numel());
  return y;
}

// The FMA peak of this machine in GFLOP/s, with the current ISA's vectors on num_threads threads.
// Both arguments are range-checked: num_threads is handed to OpenMP as an int, and the doubling of the iterations
// must stop before it overflows (a minute of probing is far more than any measurement needs).
double fma_peak_gflops(int64_t num_threads, double seconds) {
  TORCH_CHECK_VALUE(num_threads >= 1 && num_threads <= 4096, "num_threads must be >= 1 and <= 4096, got ",
                    num_threads);
  TORCH_CHECK_VALUE(seconds > 0 && seconds <= 60, "seconds must be in (0, 60], got ", seconds);
  const auto probe = kernels().fma_probe;
  int64_t iterations = 1 << 16;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    const double flops = probe(iterations, static_cast<int>(num_threads));
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed >= seconds || iterations > INT64_MAX / 2) return flops / elapsed * 1e-9;
    iterations *= 2;
  }
}

// The bf16 dot-product peak (AMX or vdpbf16ps) in GFLOP/s on num_threads threads; None where the ISA has none.
std::optional<double> bf16_peak_gflops(int64_t num_threads, double seconds) {
  TORCH_CHECK_VALUE(num_threads >= 1, "num_threads must be >= 1, got ", num_threads);
  const auto probe = kernels().bf16_dot_probe;
  if (!probe) return std::nullopt;
  int64_t iterations = 1 << 12;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    const double flops = probe(iterations, static_cast<int>(num_threads));
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed >= seconds) return flops / elapsed * 1e-9;
    iterations *= 2;
  }
}

// Sums a float32 tensor with the current ISA's vector loads on num_threads threads (the decode benchmark times it
// to measure the read bandwidth; the sum keeps the reads from being dropped).
double read_probe(const at::Tensor& x, int64_t num_threads) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a float32 CPU tensor, got ",
                   x.scalar_type(), " on ", x.device());
  TORCH_CHECK_VALUE(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK_VALUE(num_threads >= 1 && num_threads <= 4096, "num_threads must be >= 1 and <= 4096, got ",
                    num_threads);
  return kernels().read_probe(x.data_ptr<float>(), x.numel(), static_cast<int>(num_threads));
}

void set_isa_checked(const std::string& name) {
  try {
    cs149gpt::set_isa(name.c_str());
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

}  // namespace
}  // namespace cs149gpt

namespace cs149gpt {
namespace {

// Forward-mode AD (torch.autograd.forward_ad, torch.func.jvp): our ops have no forward derivative, and the autograd
// layer torch.library builds for a custom op runs it without a word for a tangent that requires no grad: the result
// would have no tangent (under jvp, a zero one). So every op is refused here, in torch's words for such an op, one
// dispatch key below Autograd, where the tensors still carry their tangents (functorch's wrappers included: they are
// unwrapped further down).
void refuse_forward_ad(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& arg = (*stack)[first + i];
    TORCH_CHECK_NOT_IMPLEMENTED(!arg.isTensor() || !arg.toTensor()._fw_grad(/*level=*/0).defined(),
                                "Trying to use forward AD with ", op.schema().name(), " that does not support it (",
                                arguments[i].name(), " has a tangent); only reverse mode (backward) is implemented");
  }
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

// The same for an op that writes some of its arguments (attention_with_kvcache's caches, `Tensor(a!)` in the
// schema): afterwards their version counters move on, as for torch's own in-place ops, so autograd notices a
// cache that a saved graph still needs.
void refuse_forward_ad_and_bump(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < arguments.size(); ++i)
    if (arguments[i].alias_info() && arguments[i].alias_info()->isWrite() && (*stack)[first + i].isTensor())
      written.push_back((*stack)[first + i].toTensor());
  refuse_forward_ad(op, keys, stack);
  for (const at::Tensor& t : written) torch::autograd::impl::bump_version(t);
}

}  // namespace
}  // namespace cs149gpt

namespace cs149gpt {
namespace {

// ---------------------------------------------------------------------------------------------------
// The eager fast path of cs149gpt.attention() and cs149gpt.scaled_dot_product_attention(): the decisions the
// Python wrappers would take (is the argument valid, must autograd see the call, does torch's SDPA take it), made
// here in a fraction of a microsecond, then the operator called through the dispatcher (so the profiler, meta
// tensors and dispatch modes see it as usual) below autograd. Python calls these only for plain tensors, outside
// torch.compile and __torch_function__; they return None where the Python wrapper must decide itself (an error to
// word, autograd to record, a fallback to torch), and the wrapper then runs its own path.
// ---------------------------------------------------------------------------------------------------
namespace py = pybind11;

using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::string&,
                               std::optional<double>, const std::string&, std::optional<int64_t>,
                               std::optional<int64_t>);
using FlashFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   std::optional<double>, const std::string&, std::optional<int64_t>,
                                                   std::optional<int64_t>, const std::optional<at::Tensor>&, int64_t,
                                                   int64_t, double, const std::optional<at::Tensor>&);

// Whether autograd (reverse or forward mode) must record a call on these tensors: then the wrappers take it.
bool autograd_needed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    if (at::GradMode::is_enabled() && t->requires_grad()) return true;
    if (t->_fw_grad(/*level=*/0).defined()) return true;
  }
  return false;
}

bool plain_dense(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && !t.is_nested() && !t.is_quantized();
}

py::object call_below_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& impl,
                               std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                               std::optional<int64_t> block_k, bool return_lse,
                               const std::optional<at::Tensor>& attn_mask = std::nullopt) {
  static const auto attention_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("cs149gpt::attention", "").typed<AttentionFn>();
  static const auto flash_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("cs149gpt::flash_attention", "").typed<FlashFn>();
  at::Tensor out, lse;
  {
    py::gil_scoped_release no_gil;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (return_lse || attn_mask)  // (attn_mask: impl is "flash", the one kernel that reads masks)
      std::tie(out, lse) = flash_op.call(q, k, v, scale, causal, block_q, block_k, attn_mask,
                                         /*window_left=*/-1, /*window_right=*/-1, /*dropout_p=*/0.0,
                                         /*dropout_seed=*/std::nullopt);
    else
      out = attention_op.call(q, k, v, impl, scale, causal, block_q, block_k);
  }
  if (return_lse) return py::make_tuple(out, lse);
  return py::cast(out);
}

// A Python float or int (not bool) that is a finite float32 into *value; false for anything else.
bool scale_from(py::handle scale, std::optional<double>* value) {
  if (scale.is_none()) return true;
  if (!(PyFloat_CheckExact(scale.ptr()) || PyLong_CheckExact(scale.ptr()))) return false;
  const double s = PyFloat_AsDouble(scale.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  if (!(std::isfinite(s) && std::fabs(s) < kFloat32Overflow)) return false;
  *value = s;
  return true;
}

// None or a Python int (not bool) that fits int64 into *value; false for anything else.
bool int_from(py::handle x, std::optional<int64_t>* value) {
  if (x.is_none()) return true;
  if (!PyLong_CheckExact(x.ptr())) return false;
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(x.ptr(), &overflow);
  if (overflow || (n == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  *value = n;
  return true;
}

// cs149gpt.attention(q, k, v, impl, scale, is_causal, block_q, block_k, return_lse) for plain tensors, or None.
// The arguments come as Python objects: anything unexpected (a wrong type too) is the Python wrapper's to word.
py::object attention_fast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, py::handle impl_arg,
                          py::handle scale_arg, py::handle is_causal, py::handle block_q_arg, py::handle block_k_arg,
                          py::handle return_lse_arg) {
  std::string causal;
  if (is_causal.is_none() || is_causal.ptr() == Py_False)
    causal = "none";
  else if (is_causal.ptr() == Py_True)
    causal = "top_left";
  else if (PyUnicode_Check(is_causal.ptr()))  // the two names cs149gpt.attention takes ("none" is not one)
    causal = is_causal.cast<std::string>();
  if (!(causal == "none" || causal == "top_left" || causal == "bottom_right") ||
      (PyUnicode_Check(is_causal.ptr()) && causal == "none"))
    return py::none();
  if (!PyUnicode_Check(impl_arg.ptr())) return py::none();
  const std::string impl = impl_arg.cast<std::string>();
  if (!(impl == "flash" || impl == "naive" || impl == "blocked" || impl == "fused")) return py::none();
  if (return_lse_arg.ptr() != Py_True && return_lse_arg.ptr() != Py_False) return py::none();
  const bool return_lse = return_lse_arg.ptr() == Py_True;
  if (return_lse && impl != "flash") return py::none();
  std::optional<double> scale;
  std::optional<int64_t> block_q, block_k;
  if (!scale_from(scale_arg, &scale) || !int_from(block_q_arg, &block_q) || !int_from(block_k_arg, &block_k))
    return py::none();
  if (!plain_dense(q) || !plain_dense(k) || !plain_dense(v) || autograd_needed(q, k, v)) return py::none();
  return call_below_autograd(q, k, v, impl, scale, causal, block_q, block_k, return_lse);
}

// Whether our kernel reads this attn_mask as torch's SDPA would (ops._mask_is_ours): a plain CPU tensor of bool,
// float32 or q's dtype, broadcastable to the scores (..., Nq, Nk), for which no gradient (reverse or forward) is
// wanted — torch computes that one.
bool mask_is_ours(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k) {
  if (!plain_dense(mask) || !mask.device().is_cpu() || mask.device() != q.device()) return false;
  const auto type = mask.scalar_type();
  if (!(type == at::kBool || type == at::kFloat || type == q.scalar_type())) return false;
  if ((at::GradMode::is_enabled() && mask.requires_grad()) || mask._fw_grad(/*level=*/0).defined()) return false;
  if (mask.dim() > q.dim()) return false;
  for (int64_t i = 1; i <= mask.dim(); ++i) {  // from the last dim: keys, queries, heads, batch...
    const int64_t m = mask.size(-i), scores = i == 1 ? k.size(-2) : q.size(-i);
    if (m != 1 && m != scores) return false;
  }
  return true;
}

// cs149gpt.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p=0.0, is_causal, scale, enable_gqa)
// for plain tensors (attn_mask None or a plain torch.Tensor: the wrapper checks their Python types) when our kernel
// takes it (the conditions of ops.uses_our_kernel without dropout) and no gradient is recorded; else None.
py::object sdpa_fast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, py::handle attn_mask_arg,
                     py::handle is_causal, py::handle scale, py::handle enable_gqa_arg) {
  if (enable_gqa_arg.ptr() != Py_True && enable_gqa_arg.ptr() != Py_False) return py::none();
  const bool enable_gqa = enable_gqa_arg.ptr() == Py_True;
  if (is_causal.ptr() != Py_True && is_causal.ptr() != Py_False) return py::none();
  std::optional<double> scale_value;
  if (!scale_from(scale, &scale_value)) return py::none();
  if (!plain_dense(q) || !plain_dense(k) || !plain_dense(v)) return py::none();
  const at::Device device = q.device();
  if (!(device.is_cpu() || device.is_cuda()) || k.device() != device || v.device() != device) return py::none();
  if (q.dim() < 3 || k.dim() != q.dim() || v.dim() != q.dim() || k.sizes() != v.sizes()) return py::none();
  const auto dtype = q.scalar_type();
  if (!(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) || k.scalar_type() != dtype ||
      v.scalar_type() != dtype)
    return py::none();
  const int64_t d = q.size(-1);
  if (device.is_cuda() && (dtype == at::kFloat || (d != 64 && d != 128))) return py::none();
  if (k.size(-1) != d || k.sizes().slice(0, k.dim() - 3) != q.sizes().slice(0, q.dim() - 3)) return py::none();
  if (q.size(-2) == 0 || d == 0 || k.size(-2) == 0) return py::none();
  const int64_t h_q = q.size(-3), h_kv = k.size(-3);
  if (h_kv == 0 || !(h_q == h_kv || (enable_gqa && h_q % h_kv == 0))) return py::none();
  if (autograd_needed(q, k, v)) return py::none();
  std::optional<at::Tensor> attn_mask;
  if (!attn_mask_arg.is_none()) {
    attn_mask = py::cast<at::Tensor>(attn_mask_arg);
    if (!mask_is_ours(*attn_mask, q, k)) return py::none();
  }
  return call_below_autograd(q, k, v, "flash", scale_value, is_causal.ptr() == Py_True ? "top_left" : "none",
                             std::nullopt, std::nullopt, false, attn_mask);
}

}  // namespace
}  // namespace cs149gpt

// The operator schema, declared once; the CPU implementation is registered apart, so another backend would
// be one more TORCH_LIBRARY_IMPL block. The outputs are laid out after the inputs' order of strides (empty_out_like,
// empty_grad_like), so the forward and backward tell torch.compile to keep that order (needs_fixed_stride_order):
// inductor may otherwise hand the kernel a contiguous copy of a transposed q, and the output would not have the
// strides the fake promised.
TORCH_LIBRARY(cs149gpt, m) {
  const std::vector<at::Tag> keep_stride_order{at::Tag::needs_fixed_stride_order};
  m.def("attention(Tensor q, Tensor k, Tensor v, str impl='flash', float? scale=None, str causal='none', "
        "int? block_q=None, int? block_k=None) -> Tensor", keep_stride_order);
  m.def("flash_attention(Tensor q, Tensor k, Tensor v, float? scale=None, str causal='none', int? block_q=None, "
        "int? block_k=None, Tensor? attn_mask=None, int window_left=-1, int window_right=-1, float dropout_p=0.0, "
        "Tensor? dropout_seed=None) -> (Tensor out, Tensor lse)", keep_stride_order);
  m.def("flash_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "float? scale=None, str causal='none', int? block_q=None, int? block_k=None, Tensor? attn_mask=None, "
        "int window_left=-1, int window_right=-1, float dropout_p=0.0, Tensor? dropout_seed=None) -> "
        "(Tensor dq, Tensor dk, Tensor dv)", keep_stride_order);
  m.def("attention_with_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
        "Tensor? k_new=None, Tensor? v_new=None, Tensor? block_table=None, float? scale=None, bool is_causal=True) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(cs149gpt, CPU, m) {
  m.impl("attention", &cs149gpt::attention);
  m.impl("flash_attention", &cs149gpt::flash_attention);
  m.impl("flash_attention_backward", &cs149gpt::flash_attention_backward);
  m.impl("attention_with_kvcache", &cs149gpt::attention_with_kvcache);
}

// Sparse, nested and quantized CPU tensors dispatch to these keys. The CPU implementations refuse them (check_attention: a
// TypeError naming the argument) before touching memory; without these registrations the dispatcher would answer
// "Could not run ... with arguments from the 'SparseCPU' backend".
#define CS149GPT_REFUSING_IMPL(KEY)                                                   \
  TORCH_LIBRARY_IMPL(cs149gpt, KEY, m) {                                              \
    m.impl("attention", &cs149gpt::attention);                                        \
    m.impl("flash_attention", &cs149gpt::flash_attention);                            \
    m.impl("flash_attention_backward", &cs149gpt::flash_attention_backward);          \
  }
CS149GPT_REFUSING_IMPL(SparseCPU)
CS149GPT_REFUSING_IMPL(SparseCsrCPU)
CS149GPT_REFUSING_IMPL(QuantizedCPU)
CS149GPT_REFUSING_IMPL(NestedTensorCPU)

TORCH_LIBRARY_IMPL(cs149gpt, ADInplaceOrView, m) {
  for (const char* op : {"attention", "flash_attention", "flash_attention_backward"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&cs149gpt::refuse_forward_ad>());
  m.impl("attention_with_kvcache", torch::CppFunction::makeFromBoxedFunction<&cs149gpt::refuse_forward_ad_and_bump>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace cs149gpt;
  namespace py = pybind11;
  m.doc() = "cs149gpt: CPU attention kernels (naive, blocked, fused, flash)";
  m.def("myNaiveAttention", &myNaiveAttention, py::call_guard<py::gil_scoped_release>());
  m.def("myUnfusedAttentionBlocked", &myUnfusedAttentionBlocked, py::call_guard<py::gil_scoped_release>());
  m.def("myFusedAttention", &myFusedAttention, py::call_guard<py::gil_scoped_release>());
  m.def("myFlashAttention", &myFlashAttention, py::call_guard<py::gil_scoped_release>());
  m.def("twoDimRead", &twoDimRead);
  m.def("fourDimRead", &fourDimRead);
  // The checks of the operators, for their fake (meta) implementations in ops.py: one source of truth.
  m.def("check_attention", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& impl,
                              std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                              std::optional<int64_t> block_k, const OptionalTensor& attn_mask, int64_t window_left,
                              int64_t window_right, double dropout_p, const OptionalTensor& dropout_seed) {
    check_attention(q, k, v, parse_impl(impl), scale, causal, block_q, block_k, attn_mask, window_left, window_right,
                    dropout_p, dropout_seed);
  }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("impl"), py::arg("scale"), py::arg("causal"),
     py::arg("block_q"), py::arg("block_k"), py::arg("attn_mask") = py::none(), py::arg("window_left") = -1,
     py::arg("window_right") = -1, py::arg("dropout_p") = 0.0, py::arg("dropout_seed") = py::none(), "raises what torch.ops.cs149gpt.attention would for these arguments, on sizes alone (meta and fake tensors too)");
  m.def("check_attention_backward", [](const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                       std::optional<double> scale, const std::string& causal,
                                       std::optional<int64_t> block_q, std::optional<int64_t> block_k,
                                       const OptionalTensor& attn_mask, int64_t window_left, int64_t window_right,
                                       double dropout_p, const OptionalTensor& dropout_seed) {
    check_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k, attn_mask, window_left,
                             window_right, dropout_p, dropout_seed);
  }, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("scale"),
     py::arg("causal"), py::arg("block_q"), py::arg("block_k"), py::arg("attn_mask") = py::none(),
     py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("dropout_p") = 0.0,
     py::arg("dropout_seed") = py::none(), "raises what torch.ops.cs149gpt.flash_attention_backward would for these arguments, on sizes alone");
  m.def("dropout_keep_mask", [](int64_t seed, int64_t offset, std::vector<int64_t> shape, double p) {
    TORCH_CHECK_VALUE(shape.size() == 4, "shape must be (batch, heads, q_len, kv_len), got ", shape.size(), " dims");
    TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, "p must be in [0, 1), got ", p);
    at::Tensor keep = checked_empty(shape, at::TensorOptions().dtype(at::kBool), "the keep mask");
    bool* out = keep.data_ptr<bool>();
    const uint64_t key = dropout_seed_key(static_cast<uint64_t>(seed));
    const uint64_t threshold = dropout_threshold(static_cast<float>(p));
    for (int64_t c = 0; c < keep.numel(); ++c)
      out[c] = dropout_keep(key, static_cast<uint64_t>(c) + static_cast<uint64_t>(offset), threshold);
    return keep;
  }, py::arg("seed"), py::arg("offset"), py::arg("shape"), py::arg("p"),
     "the keep mask (batch, heads, q_len, kv_len) the flash kernels' dropout draws for (seed, offset) (a test hook)");
  m.def("check_attention_with_kvcache", [](const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                           const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                                           const std::optional<at::Tensor>& v_new,
                                           const std::optional<at::Tensor>& block_table, std::optional<double> scale) {
    check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale);
  }, "raises what torch.ops.cs149gpt.attention_with_kvcache would for these arguments, on sizes alone");
  m.def("key_ranges_of", [](const at::Tensor& mask, const at::Tensor& q, int64_t kv_len) -> py::object {
    const KeyRanges runs = key_ranges_of(mask_as_4d(mask, q, kv_len));
    return runs.ranges.defined() ? py::make_tuple(runs.ranges, runs.plain) : py::object(py::none());
  }, "An attn_mask's (first, end) run of shown keys per distinct row, as the flash kernels receive it, and whether the "
     "runs add nothing (the mask is then not read); None if a row shows two runs or more, or the mask is left to the "
     "kernels unscanned (tests)");
  m.def("attention_fast", &attention_fast, "cs149gpt.attention's eager path for plain tensors (None: not taken)");
  m.def("sdpa_fast", &sdpa_fast,
        "cs149gpt.scaled_dot_product_attention's eager path without dropout (None: not taken)");
  m.def("isa", &isa, "the instruction set the kernels run with: amx, avx512_bf16, avx512, avx2, scalar or amx_emulated");
  m.def("set_isa", &set_isa_checked, "force the kernels' instruction set (amx, avx512_bf16, avx512, avx2, scalar; amx_emulated for tests)");
  m.def("set_backward_path", [](const std::string& path) {
    TORCH_CHECK_VALUE(path == "auto" || path == "one_pass" || path == "two_pass",
                      "path must be 'auto', 'one_pass' or 'two_pass'; got '", path, "'");
    g_backward_path = path;
  }, "force the flash backward's algorithm ('one_pass', 'two_pass'), or let the shape decide ('auto', the default)");
  m.def("backward_path", [] { return g_backward_path; }, "the flash backward's algorithm setting (set_backward_path)");
  m.def("set_float32_products", [](const std::string& how) {
    TORCH_CHECK_VALUE(how == "auto" || how == "fma" || how == "bf16_tiles",
                      "how must be 'auto', 'fma' or 'bf16_tiles'; got '", how, "'");
    g_float32_products = how == "fma" ? F32Products::fma
                         : how == "bf16_tiles" ? F32Products::bf16_tiles : F32Products::automatic;
  }, "force how the flash forward multiplies float32 where the ISA has AMX tiles: float32 FMAs ('fma'), or the bf16 "
     "tiles with each operand in three bf16 parts ('bf16_tiles': 1.1-1.25x faster on one thread at head_dim >= 96, "
     "slower on 8 and 16); 'auto' (the default): FMAs");
  m.def("set_backward_key_chunks", [](int64_t chunks) {
    TORCH_CHECK_VALUE(chunks >= 0 && chunks <= 8, "chunks must be in [0, 8] (0: decided by shape), got ", chunks);
    g_backward_key_chunks = chunks;
  }, "force the one-pass backward to split each kv head's keys into this many tasks (0: decided by shape)");
  m.def("set_backward_head_parts", [](int64_t parts) {
    TORCH_CHECK_VALUE(parts >= 0 && parts <= 64, "parts must be in [0, 64] (0: decided by shape), got ", parts);
    g_backward_head_parts = parts;
  }, "force the float32 one-pass backward to split each kv head's query heads into this many parts (its greatest "
     "common divisor with the group size; 0: decided by shape)");
  m.def("fma_peak_gflops", &fma_peak_gflops, py::arg("num_threads") = 1, py::arg("seconds") = 0.2,
        py::call_guard<py::gil_scoped_release>(),
        "measured FMA peak in GFLOP/s of the current ISA's vectors on num_threads threads");
  m.def("bf16_peak_gflops", &bf16_peak_gflops, py::arg("num_threads") = 1, py::arg("seconds") = 0.2,
        py::call_guard<py::gil_scoped_release>(),
        "measured bf16 dot-product peak in GFLOP/s (AMX or vdpbf16ps) on num_threads threads; None without one");
  m.def("read_probe", &read_probe, py::arg("x"), py::arg("num_threads") = 1, py::call_guard<py::gil_scoped_release>(),
        "sum of a float32 tensor read with vector loads on num_threads threads (time it: read bandwidth)");
  m.def("amx_unavailable_reason", [] { return std::string(amx_unavailable_reason()); },
        "why the AMX kernels are not used on a CPU that has AMX (the kernel refused the permission), or ''");
  m.def("vector_exp", &vector_exp, "exp by the kernels' vectorised exp (current ISA), for tests");
  m.def("vector_exp2", &vector_exp2, "2^x by the kernels' vectorised 2^x (current ISA), for tests");
  m.def("cpu_supports", [](const std::string& name) { return cpu_supports(name.c_str()); },
        "whether this CPU runs the kernels of the named instruction set");
  m.def("amx_emulation_restores_tile_config", [] {
        TORCH_CHECK_NOT_IMPLEMENTED(cpu_supports("amx_emulated"),
                                    "amx_emulation_restores_tile_config needs a CPU that runs amx_emulated "
                                    "(AVX512-BF16)");
        return amx_emulated::restores_tile_config();
      },
        "tests: under emulated tiles, a foreign tile configuration is back after one of our bf16 products, and none "
        "is left where there was none");
}
