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

#include <ATen/TensorUtils.h>

#include <array>
#include <chrono>
#include <iomanip>
#include <cmath>
#include <optional>
#include <sstream>
#include <tuple>
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
DType check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Impl impl,
                      std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                      std::optional<int64_t> block_k) {
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
    // Two checks, one message: hq % 0 must never be evaluated.
    CHECK_SIZES(hkv.sym_ge(1), "the heads of q (dim -3) must be a multiple of those of k and v, got q ",
                q.sym_sizes(), ", k ", k.sym_sizes());
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
                               std::optional<int64_t> block_k) {
  const DType dtype = check_attention(q, k, v, Impl::flash, scale, causal, block_q, block_k);
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

int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size : INT64_MAX;
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
void check_fits(int64_t count, int64_t elem_size, const std::string& what) {
  const int64_t bytes = checked_product({count, elem_size});
  TORCH_CHECK_WITH(OutOfMemoryError, bytes >= 0, what, " is beyond any machine's memory: its size overflows int64");
  TORCH_CHECK_WITH(OutOfMemoryError, bytes <= physical_memory_bytes(), what, " needs ", gib(bytes),
                   " GiB, more than this machine's memory (", gib(physical_memory_bytes()), " GiB)");
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
    check_fits(t.numel(), t.element_size(), std::string("a copy of ") + shape_of(name, t.sizes()));
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
  AttentionParams p;
};

// Fills the params of a call whose arguments check_attention has passed (it returned dtype).
Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Impl impl, DType dtype,
                 std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                 std::optional<int64_t> block_k) {
  // Meta tensors pass check_attention (the fake implementations share it); the kernels need memory.
  TORCH_CHECK_VALUE(q.device().is_cpu(), "q must be on the CPU, got a tensor on ", q.device());
  const int64_t d = q.size(-1), q_len = q.size(-2), kv_len = k.size(-2);
  const double scale_value = scale.value_or(1.0 / std::sqrt(static_cast<double>(d)));

  Prepared prep{as_4d(q, "q"), as_4d(k, "k"), as_4d(v, "v"), {}};
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
// below 19·K + 27·T (Bc = 1 pads every key to a vector); flash_decode.cpp's below 4·K + T; fused.cpp's below T;
// naive and blocked's is Nq·Nk. So while 64·(Q + K + T) + Nq·Nk fits, none of the kernels' formulas overflows.
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

// A kernel's workspace, through torch's allocator: the profiler counts it, and a failure is a Python exception.
// The kernel's own formula runs only once the bound says it cannot overflow.
template <class Params, class K>
at::Tensor workspace(const K& kernel, const Params& params, const AttentionParams& p, const std::string& what) {
  const int64_t bound = workspace_bound_floats(p);
  const bool formula_fits = bound >= 0 && bound <= INT64_MAX / static_cast<int64_t>(sizeof(float));
  const int64_t floats = formula_fits ? kernel.workspace_floats(params) : -1;
  check_fits(floats, sizeof(float), what + " for " + sizes_of(p));
  return at::empty({floats}, at::TensorOptions().dtype(at::kFloat));
}

// An output of these sizes (the kernels write every element), checked before it is allocated.
at::Tensor checked_empty(at::IntArrayRef sizes, const at::TensorOptions& options, const char* name) {
  check_fits(checked_product(sizes),
             static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype()))),
             shape_of(name, sizes));
  return at::empty(sizes, options);
}

// Runs one forward kernel. Returns (out, lse); lse is defined only when asked for (flash only).
std::tuple<at::Tensor, at::Tensor> run_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 Impl impl, std::optional<double> scale, const std::string& causal,
                                                 std::optional<int64_t> block_q, std::optional<int64_t> block_k,
                                                 bool want_lse) {
  TORCH_CHECK_VALUE(!want_lse || impl == Impl::flash, "lse is computed by impl='flash' only");
  const DType dtype = check_attention(q, k, v, impl, scale, causal, block_q, block_k);
  Prepared prep = prepare(q, k, v, impl, dtype, scale, causal, block_q, block_k);
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
    case Impl::flash: kernel = &kernels.flash; break;
  }
  at::Tensor out = checked_empty({p.batch, p.num_heads, p.q_len, p.head_dim}, q.options(), "out");
  p.out = out.data_ptr();
  fill_strides(p.out_strides, out);
  at::Tensor lse;
  if (want_lse) {
    lse = checked_empty({p.batch, p.num_heads, p.q_len}, q.options().dtype(at::kFloat), "lse");
    p.lse = lse.data_ptr<float>();
    p.lse_strides[0] = lse.stride(0);
    p.lse_strides[1] = lse.stride(1);
  }

  if (p.batch * p.num_heads > 0)
    kernel->run(p, workspace(*kernel, p, p, std::string("the workspace of impl='") + impl_name(impl) + "'")
                       .data_ptr<float>());
  const auto lead = q.sizes().slice(0, q.dim() - 1);
  return {out.view(q.sizes()), want_lse ? lse.view(lead) : lse};
}

}  // namespace

// attention(q, k, v, impl, scale, causal, block_q, block_k) -> out
//   q: (..., Nq, d); k, v: (..., Nk, d) with the same leading dims, except that the head dim (-3) of k and v
//   may divide q's (grouped-query attention). out: (..., Nq, d), contiguous, q's dtype.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& impl,
                     std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                     std::optional<int64_t> block_k) {
  return std::get<0>(run_attention(q, k, v, parse_impl(impl), scale, causal, block_q, block_k, false));
}

// flash_attention(q, k, v, scale, causal, block_q, block_k) -> (out, lse)
//   lse: (..., Nq) float32, the logsumexp of each query row's scaled, masked logits (−inf for a row that
//   sees no key). The backward pass recomputes P from it.
std::tuple<at::Tensor, at::Tensor> flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   std::optional<double> scale, const std::string& causal,
                                                   std::optional<int64_t> block_q, std::optional<int64_t> block_k) {
  return run_attention(q, k, v, Impl::flash, scale, causal, block_q, block_k, true);
}

// The flash backward's algorithm for these params. One pass (flash_backward_onepass.cpp, flash_backward_bf16.cpp:
// five tile products, a task per (batch, kv head) owning its gradient rows; split into key_chunks runs of key tiles
// when there are too few of them for the CPUs, each run's dQ summed in order afterwards) when its tasks keep at
// least kOnePassMinBusy of this machine's CPUs busy; two passes (seven products, tasks per tile) otherwise.
// Decided from the shape and the machine's CPU count, never the call's thread count, so that the gradients' bits do
// not depend on it. set_backward_path() / set_backward_key_chunks() force them (tests run every path).
constexpr double kOnePassMinBusy = 0.6;  // the one-pass kernel measured ~1.6x the two-pass one's speed per thread
constexpr double kKeyChunksBusy = 0.85;  // split a kv head's keys until this many of the CPUs are busy
constexpr int64_t kMaxKeyChunks = 8, kMinKeysPerChunk = 128;
std::string g_backward_path = "auto";
int64_t g_backward_key_chunks = 0;  // 0: decided by shape

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

void choose_backward(AttentionBackwardParams& bp) {
  const AttentionParams& p = bp.fwd;
  const int64_t pairs = p.batch * p.num_kv_heads, cpus = machine_cpus();
  const int64_t most_chunks = std::clamp<int64_t>(p.kv_len / kMinKeysPerChunk, 1, kMaxKeyChunks);
  int64_t chunks = 1;
  while (chunks * 2 <= most_chunks && busy_share(pairs * chunks, cpus) < kKeyChunksBusy) chunks *= 2;
  if (g_backward_key_chunks > 0) chunks = g_backward_key_chunks;
  bp.key_chunks = chunks;
  if (g_backward_path != "auto")
    bp.path = g_backward_path == "one_pass" ? BackwardPath::one_pass : BackwardPath::two_pass;
  else
    bp.path = busy_share(pairs * chunks, cpus) >= kOnePassMinBusy ? BackwardPath::one_pass : BackwardPath::two_pass;
}

// flash_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k) -> (dq, dk, dv)
//   The gradients of flash_attention's out with respect to q, k, v, given dout = ∂L/∂out and the forward's
//   out and lse; P is recomputed tile by tile from lse (flash_backward.cpp). dk, dv have k's and v's shape.
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
    std::optional<int64_t> block_k) {
  const DType dtype = check_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k);
  Prepared prep = prepare(q, k, v, Impl::flash, dtype, scale, causal, block_q, block_k);

  AttentionBackwardParams bp;
  bp.fwd = prep.p;
  choose_backward(bp);
  at::Tensor dq = checked_empty(prep.q4.sizes(), q.options(), "dq");
  at::Tensor dk = checked_empty(prep.k4.sizes(), k.options(), "dk");
  at::Tensor dv = checked_empty(prep.v4.sizes(), v.options(), "dv");
  const at::Tensor dout4 = as_4d(dout, "dout"), out4 = as_4d(out, "out");
  const at::Tensor lse3 = lse.reshape({bp.fwd.batch, bp.fwd.num_heads, bp.fwd.q_len}).contiguous();
  bp.fwd.out = out4.data_ptr();
  fill_strides(bp.fwd.out_strides, out4);
  bp.fwd.lse = const_cast<float*>(lse3.data_ptr<float>());
  bp.fwd.lse_strides[0] = lse3.stride(0);
  bp.fwd.lse_strides[1] = lse3.stride(1);
  bp.dout = dout4.data_ptr();
  fill_strides(bp.dout_strides, dout4);
  bp.dq = dq.data_ptr();
  bp.dk = dk.data_ptr();
  bp.dv = dv.data_ptr();
  fill_strides(bp.dq_strides, dq);
  fill_strides(bp.dk_strides, dk);
  fill_strides(bp.dv_strides, dv);
  if (bp.fwd.batch * bp.fwd.num_heads > 0) {
    const BackwardKernel& kernel = kernels().flash_backward;
    kernel.run(bp, workspace(kernel, bp, bp.fwd, "the workspace of the flash backward").data_ptr<float>());
  }
  return {dq.view(q.sizes()), dk.view(k.sizes()), dv.view(v.sizes())};
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

}  // namespace
}  // namespace cs149gpt

// The operator schema, declared once; the CPU implementation is registered apart, so another backend would
// be one more TORCH_LIBRARY_IMPL block.
TORCH_LIBRARY(cs149gpt, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, str impl='flash', float? scale=None, str causal='none', "
        "int? block_q=None, int? block_k=None) -> Tensor");
  m.def("flash_attention(Tensor q, Tensor k, Tensor v, float? scale=None, str causal='none', int? block_q=None, "
        "int? block_k=None) -> (Tensor out, Tensor lse)");
  m.def("flash_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "float? scale=None, str causal='none', int? block_q=None, int? block_k=None) -> (Tensor dq, Tensor dk, "
        "Tensor dv)");
}

TORCH_LIBRARY_IMPL(cs149gpt, CPU, m) {
  m.impl("attention", &cs149gpt::attention);
  m.impl("flash_attention", &cs149gpt::flash_attention);
  m.impl("flash_attention_backward", &cs149gpt::flash_attention_backward);
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
                              std::optional<int64_t> block_k) {
    check_attention(q, k, v, parse_impl(impl), scale, causal, block_q, block_k);
  }, "raises what torch.ops.cs149gpt.attention would for these arguments, on sizes alone (meta and fake tensors too)");
  m.def("check_attention_backward", [](const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                       std::optional<double> scale, const std::string& causal,
                                       std::optional<int64_t> block_q, std::optional<int64_t> block_k) {
    check_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k);
  }, "raises what torch.ops.cs149gpt.flash_attention_backward would for these arguments, on sizes alone");
  m.def("isa", &isa, "the instruction set the kernels run with: amx, avx512_bf16, avx512, avx2 or scalar");
  m.def("set_isa", &set_isa_checked, "force the kernels' instruction set (amx, avx512_bf16, avx512, avx2, scalar)");
  m.def("set_backward_path", [](const std::string& path) {
    TORCH_CHECK_VALUE(path == "auto" || path == "one_pass" || path == "two_pass",
                      "path must be 'auto', 'one_pass' or 'two_pass'; got '", path, "'");
    g_backward_path = path;
  }, "force the flash backward's algorithm ('one_pass', 'two_pass'), or let the shape decide ('auto', the default)");
  m.def("backward_path", [] { return g_backward_path; }, "the flash backward's algorithm setting (set_backward_path)");
  m.def("set_backward_key_chunks", [](int64_t chunks) {
    TORCH_CHECK_VALUE(chunks >= 0 && chunks <= 8, "chunks must be in [0, 8] (0: decided by shape), got ", chunks);
    g_backward_key_chunks = chunks;
  }, "force the one-pass backward to split each kv head's keys into this many tasks (0: decided by shape)");
  m.def("fma_peak_gflops", &fma_peak_gflops, py::arg("num_threads") = 1, py::arg("seconds") = 0.2,
        py::call_guard<py::gil_scoped_release>(),
        "measured FMA peak in GFLOP/s of the current ISA's vectors on num_threads threads");
  m.def("bf16_peak_gflops", &bf16_peak_gflops, py::arg("num_threads") = 1, py::arg("seconds") = 0.2,
        py::call_guard<py::gil_scoped_release>(),
        "measured bf16 dot-product peak in GFLOP/s (AMX or vdpbf16ps) on num_threads threads; None without one");
  m.def("amx_unavailable_reason", [] { return std::string(amx_unavailable_reason()); },
        "why the AMX kernels are not used on a CPU that has AMX (the kernel refused the permission), or ''");
  m.def("vector_exp", &vector_exp, "exp by the kernels' vectorised exp (current ISA), for tests");
  m.def("cpu_supports", [](const std::string& name) { return cpu_supports(name.c_str()); },
        "whether this CPU runs the kernels of the named instruction set");
}
