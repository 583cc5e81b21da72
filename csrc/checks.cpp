// The argument checks of every operator and the filling of the params struct (checks.h says who calls them).
#include "checks.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/TensorUtils.h>
#include <ATen/Parallel.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <iomanip>
#include <sstream>
#include <tuple>

#include <c10/util/FunctionRef.h>

#include "heuristics.h"
#include "mask_ranges.h"

namespace cs149gpt {

Impl parse_impl(const std::string& impl) {
  if (impl == "naive") return Impl::naive;
  if (impl == "blocked") return Impl::blocked;
  if (impl == "fused") return Impl::fused;
  if (impl == "flash") return Impl::flash;
  if (impl == "flash_teaching") return Impl::flash_teaching;
  TORCH_CHECK_VALUE(false, "impl must be one of 'naive', 'blocked', 'fused', 'flash', 'flash_teaching'; got '", impl,
                    "'");
}

const char* impl_name(Impl impl) {
  switch (impl) {
    case Impl::naive: return "naive";
    case Impl::blocked: return "blocked";
    case Impl::fused: return "fused";
    case Impl::flash: return "flash";
    case Impl::flash_teaching: return "flash_teaching";
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

// A plain dense tensor (check_tensor: of at least 2 dims; check_varlen checks its own ranks). Sparse, nested and
// quantized tensors are refused here, by name, rather than left to the dispatcher's "Could not run ... with arguments
// from the 'SparseCPU' backend".
static void check_plain(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, name, " must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK_TYPE(!t.is_nested(), name, " must be a dense (strided) tensor, not a nested tensor");
  TORCH_CHECK_TYPE(!t.is_quantized(), name, " must be a float tensor, not quantized; got ", t.scalar_type());
}
void check_tensor(const at::Tensor& t, const char* name) {
  check_plain(t, name);
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

c10::SymBool equal_sizes(c10::SymIntArrayRef a, c10::SymIntArrayRef b) {
  if (a.size() != b.size()) return false;
  c10::SymBool equal = true;
  for (size_t i = 0; i < a.size(); ++i) equal = equal.sym_and(a[i].sym_eq(b[i]));
  return equal;
}

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

// q, k and v on one device, of one dtype that impl takes. Returns it.
static DType check_dtypes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Impl impl) {
  check_devices({{"q", &q}, {"k", &k}, {"v", &v}});
  const DType dtype = parse_dtype(q, impl);
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "q, k and v must share one dtype, got q ", q.scalar_type(), ", k ", k.scalar_type(), ", v ",
                   v.scalar_type());
  return dtype;
}

static void check_scale(std::optional<double> scale) {
  if (scale)
    TORCH_CHECK_VALUE(std::isfinite(*scale) && std::fabs(*scale) < kFloat32Overflow,
                      "scale must be a finite float32, got ", *scale);
}

// The options a dense call (check_attention) and a varlen one (check_varlen) check alike, once their shapes have
// passed: window, dropout, softcap, alibi_slopes (its shape by slopes_shape, which knows the call's layout), then what
// CUDA tensors cannot take. q's last dim is d in both layouts.
static void check_options(const at::Tensor& q, Impl impl, DType dtype, bool has_mask, int64_t window_left,
                          int64_t window_right, double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                          const OptionalTensor& alibi_slopes,
                          c10::function_ref<void(const at::Tensor&)> slopes_shape) {
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
  // softcap and ALiBi: the flash kernel's (the other rungs refuse them; on CUDA, float32 below).
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0 && softcap < kFloat32Overflow / 2,
                    "softcap must be a finite float32 >= 0 (0: no softcap), got ", softcap);
  TORCH_CHECK_VALUE(softcap == 0.0 || impl == Impl::flash, "softcap needs impl='flash', got impl='", impl_name(impl),
                    "'");
  if (is_given(alibi_slopes)) {
    const at::Tensor& s = *alibi_slopes;
    TORCH_CHECK_VALUE(impl == Impl::flash, "alibi_slopes needs impl='flash', got impl='", impl_name(impl), "'");
    TORCH_CHECK_TYPE(s.layout() == at::kStrided && !s.is_nested() && !s.is_quantized(),
                     "alibi_slopes must be a dense (strided) float32 tensor");
    TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "alibi_slopes must be float32, got ", s.scalar_type());
    check_devices({{"q", &q}, {"alibi_slopes", &s}});
    TORCH_CHECK_VALUE(!s.requires_grad(), "alibi_slopes gets no gradient: pass it with requires_grad=False "
                      "(alibi_slopes.detach())");
    slopes_shape(s);
  }
  // What only the CPU kernels run, refused here for CUDA tensors (fake ones too), so that eager mode,
  // FakeTensorMode and torch.compile refuse a call alike, before anything is traced or launched.
  if (q.device().is_cuda()) {
    TORCH_CHECK_VALUE(impl == Impl::flash, "impl='", impl_name(impl), "' runs on the CPU only; on CUDA tensors use "
                      "impl='flash' (float32: the one-thread-per-row teaching kernel; bfloat16/float16: "
                      "FlashAttention-2)");
    // The tensor-core kernels take every option (their general path); the float32 teaching kernel none.
    const char* teaching = " on CUDA needs bfloat16 or float16 (float32 runs the teaching kernel, plain and causal "
                           "attention only)";
    TORCH_CHECK_NOT_IMPLEMENTED(dtype != DType::f32 || dropout_p == 0.0, "dropout_p", teaching);
    TORCH_CHECK_NOT_IMPLEMENTED(dtype != DType::f32 || !has_mask, "attn_mask", teaching);
    TORCH_CHECK_NOT_IMPLEMENTED(dtype != DType::f32 || (window_left == -1 && window_right == -1), "window", teaching);
    TORCH_CHECK_NOT_IMPLEMENTED(dtype != DType::f32 || softcap == 0.0, "softcap", teaching);
    TORCH_CHECK_NOT_IMPLEMENTED(dtype != DType::f32 || !is_given(alibi_slopes), "alibi_slopes", teaching);
    // The tensor-core kernels are instantiated for these head dims (csrc/cuda/flash_launch.cuh).
    const c10::SymInt d = q.sym_size(-1);
    if (dtype != DType::f32)
      CHECK_SIZES(d.sym_eq(64).sym_or(d.sym_eq(128)), "CUDA flash attention in ", q.scalar_type(),
                  " supports head dim d = 64 or 128, got d = ", d, " (float32 runs the teaching kernel, for any d)");
  }
}

// Every check of an attention call that needs no data: dtypes, devices, ranks, shapes (GQA divisibility included),
// scale, causal mode, tiles. Written on symbolic sizes, so one function serves the CPU kernels (run_attention) and
// the fake/meta implementations in ops.py (the module's check_attention, called with FakeTensors whose sizes are
// SymInts under torch.compile): eager, meta, FakeTensorMode and torch.compile refuse the same inputs with the same
// message. Returns the dtype of the call.
DType check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Impl impl,
                      std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                      std::optional<int64_t> block_k, const OptionalTensor& attn_mask, int64_t window_left,
                      int64_t window_right, double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                      const OptionalTensor& alibi_slopes) {
  check_tensor(q, "q");
  check_tensor(k, "k");
  check_tensor(v, "v");
  const DType dtype = check_dtypes(q, k, v, impl);
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
  check_scale(scale);
  TORCH_CHECK_VALUE(causal == "none" || causal == "top_left" || causal == "bottom_right",
                    "causal must be 'none', 'top_left' or 'bottom_right'; got '", causal, "'");
  // Tile sizes are checked whatever the impl, so a typo is never silently ignored.
  if (block_q) TORCH_CHECK_VALUE(*block_q >= 1, "block_q must be >= 1, got ", *block_q);
  if (block_k) TORCH_CHECK_VALUE(*block_k >= 1, "block_k must be >= 1, got ", *block_k);
  if (is_given(attn_mask)) {
    TORCH_CHECK_VALUE(impl == Impl::flash, "attn_mask needs impl='flash', got impl='", impl_name(impl), "'");
    check_mask(*attn_mask, q, k);
  }
  // (Hq,), or q's leading dims then Hq: (B, Hq) for q of shape (B, Hq, Nq, d).
  const auto slopes_shape = [&](const at::Tensor& s) {
    const c10::SymInt hq = rank >= 3 ? q.sym_size(-3) : c10::SymInt(1);
    const auto heads_lead = q.sym_sizes().slice(0, std::max<int64_t>(rank - 2, 0));
    const bool per_head = s.dim() == 1 && s.sym_size(0) == hq;
    CHECK_SIZES(c10::SymBool(per_head).sym_or(equal_sizes(s.sym_sizes(), heads_lead)),
                "alibi_slopes must have shape (", hq, ",) (one slope per query head) or ", heads_lead,
                " (q's leading dims: one per batch element and head); got ", s.sym_sizes());
  };
  check_options(q, impl, dtype, is_given(attn_mask), window_left, window_right, dropout_p, dropout_seed, softcap,
                alibi_slopes, slopes_shape);
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

// What both backwards check after their forward's checks: dout and out like q, lse a dense tensor (its shape and
// dtype are the caller's: dense and packed layouts differ); float32 on CUDA has no backward.
static void check_backward_tensors(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out,
                                   const at::Tensor& lse, DType dtype) {
  TORCH_CHECK_TYPE(!q.device().is_cuda() || dtype != DType::f32, "the CUDA flash backward takes bfloat16 or float16; "
                   "float32 on CUDA has the teaching forward only (run the backward in bfloat16/float16, or on the CPU)");
  check_like(dout, "dout", q, "q");
  check_like(out, "out", q, "q");
  TORCH_CHECK_VALUE(lse.defined(), "lse must be a tensor, got None");
  TORCH_CHECK_TYPE(lse.layout() == at::kStrided, "lse must be a dense (strided) tensor, got layout ", lse.layout());
}

// The backward's arguments: the forward's checks on q, k, v, then dout and out shaped like q, lse like q without
// its last dim, float32; all six on one device.
DType check_attention_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& out, const at::Tensor& lse, std::optional<double> scale,
                               const std::string& causal, std::optional<int64_t> block_q,
                               std::optional<int64_t> block_k, const OptionalTensor& attn_mask,
                               int64_t window_left, int64_t window_right, double dropout_p,
                               const OptionalTensor& dropout_seed, double softcap,
                               const OptionalTensor& alibi_slopes) {
  const DType dtype = check_attention(q, k, v, Impl::flash, scale, causal, block_q, block_k, attn_mask, window_left,
                                      window_right, dropout_p, dropout_seed, softcap, alibi_slopes);
  check_backward_tensors(dout, q, out, lse, dtype);
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

// float32's products on AMX (AttentionParams::f32_products): set_float32_products() chooses; automatic is float32
// FMAs (flash_bf16.cpp, takes_float32, has the measurements).
F32Products g_float32_products = F32Products::automatic;

DType check_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                   const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                   std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
                   double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                   const OptionalTensor& alibi_slopes, const OptionalTensor& block_table) {
  const bool paged = is_given(block_table);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q}, {"k", &k}, {"v", &v}}) {
    check_plain(*t, name);
    if (paged && t != &q) {
      TORCH_CHECK_VALUE(t->dim() == 4, name, " must be (num_blocks, page_block_size, heads_kv, head_dim), a paged KV "
                        "cache (block_table is given), got shape ", t->sym_sizes());
    } else {
      TORCH_CHECK_VALUE(t->dim() == 3, name, " must be (total_tokens, heads, head_dim), the sequences packed one after "
                        "another, got shape ", t->sym_sizes());
    }
  }
  if (paged) {
    TORCH_CHECK_TYPE(block_table->layout() == at::kStrided && !block_table->is_nested(),
                     "block_table must be a dense (strided) tensor, got layout ", block_table->layout());
    TORCH_CHECK_TYPE(block_table->scalar_type() == at::kInt, "block_table must be int32, got ",
                     block_table->scalar_type());
    TORCH_CHECK_VALUE(block_table->dim() == 2, "block_table must be (batch, max_blocks), got shape ",
                      block_table->sym_sizes());
    CHECK_SIZES(block_table->sym_size(0).sym_eq(cu_seqlens_k.sym_size(0) - 1), "block_table must be (batch, "
                "max_blocks) with batch = len(cu_seqlens_k) - 1 = ", cu_seqlens_k.sym_size(0) - 1, ", got shape ",
                block_table->sym_sizes());
    CHECK_SIZES(equal_sizes(v.sym_sizes(), k.sym_sizes()), "v must have k's shape (num_blocks, page_block_size, "
                "heads_kv, head_dim) ", k.sym_sizes(), ", got ", v.sym_sizes());
    CHECK_SIZES(k.sym_size(1).sym_ge(1), "k's page_block_size (dim 1) must be >= 1, got shape ", k.sym_sizes());
    check_devices({{"q", &q}, {"block_table", &*block_table}});
  }
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor*>{"cu_seqlens_q", &cu_seqlens_q}, {"cu_seqlens_k", &cu_seqlens_k}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kInt, name, " must be int32 (FlashAttention's), got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->dim() == 1, name, " must be 1-D, (batch + 1,), got shape ", t->sym_sizes());
    CHECK_SIZES(t->sym_size(0).sym_ge(2), name, " must hold batch + 1 >= 2 offsets, got shape ", t->sym_sizes());
  }
  CHECK_SIZES(cu_seqlens_q.sym_size(0).sym_eq(cu_seqlens_k.sym_size(0)), "cu_seqlens_q and cu_seqlens_k must both "
              "be (batch + 1,), got ", cu_seqlens_q.sym_sizes(), " and ", cu_seqlens_k.sym_sizes());
  check_devices({{"q", &q}, {"cu_seqlens_q", &cu_seqlens_q}, {"cu_seqlens_k", &cu_seqlens_k}});
  TORCH_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_k >= 0, "max_seqlen_q and max_seqlen_k must be >= 0, got ",
                    max_seqlen_q, " and ", max_seqlen_k);
  const DType dtype = check_dtypes(q, k, v, Impl::flash);
  // Shapes in the caller's layout: q (total_q, Hq, d); k and v (total_k, Hkv, d), or a paged cache's
  // (num_blocks, page_block_size, Hkv, d). No token is needed: total_q or total_k 0 (sequences all empty) gives empty
  // or zero outputs, as FlashAttention's.
  const int64_t kv_heads_dim = paged ? 2 : 1;
  const c10::SymInt d = q.sym_size(2), hq = q.sym_size(1), hkv = k.sym_size(kv_heads_dim);
  CHECK_SIZES(d.sym_ge(1), "head dim d (the last dim of q) must be >= 1, got q of shape ", q.sym_sizes());
  CHECK_SIZES(k.sym_size(-1).sym_eq(d).sym_and(v.sym_size(-1).sym_eq(d)), "k and v must have head dim d = ", d,
              " (the last dim of q), got k ", k.sym_sizes(), ", v ", v.sym_sizes());
  if (!paged)  // (a paged v has k's shape, checked above)
    CHECK_SIZES(v.sym_size(0).sym_eq(k.sym_size(0)), "k and v must have the same number of tokens total_k (dim 0), "
                "got k ", k.sym_sizes(), ", v ", v.sym_sizes());
  CHECK_SIZES(v.sym_size(kv_heads_dim).sym_eq(hkv), "k and v must have the same number of heads (dim ", kv_heads_dim,
              "), got k ", k.sym_sizes(), ", v ", v.sym_sizes());
  // First: hq % 0 must never be evaluated.
  CHECK_SIZES(hkv.sym_ge(1), "k and v must have at least one head (dim ", kv_heads_dim, "), got k ", k.sym_sizes(),
              ", v ", v.sym_sizes());
  CHECK_SIZES((hq % hkv).sym_eq(0), "the heads of q (dim 1) must be a multiple of those of k and v (dim ",
              kv_heads_dim, "), got q ", q.sym_sizes(), ", k ", k.sym_sizes());
  check_scale(scale);
  // ALiBi slopes: (Hq,), or (batch, Hq), a row per sequence.
  const auto slopes_shape = [&](const at::Tensor& s) {
    const c10::SymInt batch = cu_seqlens_q.sym_size(0) - 1;
    const c10::SymBool per_head = s.dim() == 1 ? s.sym_size(0).sym_eq(hq) : c10::SymBool(false);
    const c10::SymBool per_sequence =
        s.dim() == 2 ? s.sym_size(0).sym_eq(batch).sym_and(s.sym_size(1).sym_eq(hq)) : c10::SymBool(false);
    CHECK_SIZES(per_head.sym_or(per_sequence), "alibi_slopes must be (heads,) or (batch, heads) with batch = "
                "len(cu_seqlens_q) - 1 = ", batch, " and heads = ", hq, " (q's dim 1); got shape ", s.sym_sizes());
  };
  check_options(q, Impl::flash, dtype, false, window_left, window_right, dropout_p, dropout_seed, softcap,
                alibi_slopes, slopes_shape);
  // The CUDA varlen kernels take what dense CUDA calls take; a paged cache only on the tensor-core kernels (the
  // float32 teaching kernel reads packed k and v; csrc/cuda/flash_api.cpp).
  if (q.device().is_cuda())
    TORCH_CHECK_NOT_IMPLEMENTED(!paged || dtype != DType::f32, "block_table (a paged KV cache) in varlen_attention on "
                                "CUDA needs bfloat16 or float16 (the float32 CUDA kernel reads packed k and v only), "
                                "got float32; pass k and v packed, (total_k, heads_kv, head_dim)");
  return dtype;
}

DType check_varlen_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
                            const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                            std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
                            double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                            const OptionalTensor& alibi_slopes) {
  const DType dtype = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                                   window_left, window_right, dropout_p, dropout_seed, softcap, alibi_slopes);
  check_backward_tensors(dout, q, out, lse, dtype);
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, "lse must be float32, got ", lse.scalar_type());
  const c10::SymInt heads = q.sym_size(1), total_q = q.sym_size(0);
  CHECK_SIZES(equal_sizes(lse.sym_sizes(), {heads, total_q}),
              "lse must be (heads, total_q) = (", heads, ", ", total_q, "), got shape ", lse.sym_sizes());
  check_devices({{"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}});
  return dtype;
}

std::pair<int64_t, int64_t> varlen_lengths(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                           int64_t total_q, int64_t total_k, int64_t max_seqlen_q,
                                           int64_t max_seqlen_k, bool* covers) {
  std::pair<int64_t, int64_t> longest{0, 0};
  *covers = true;
  for (int side = 0; side < 2; ++side) {
    const at::Tensor cu = (side == 0 ? cu_seqlens_q : cu_seqlens_k).contiguous();
    const char* name = side == 0 ? "cu_seqlens_q" : "cu_seqlens_k";
    const int64_t total = side == 0 ? total_q : total_k, bound = side == 0 ? max_seqlen_q : max_seqlen_k;
    const int32_t* at = cu.data_ptr<int32_t>();
    const int64_t n = cu.size(0);
    TORCH_CHECK_VALUE(at[0] >= 0, name, "[0] must be >= 0, got ", at[0]);
    int64_t most = 0;
    for (int64_t b = 0; b + 1 < n; ++b) {
      TORCH_CHECK_VALUE(at[b + 1] >= at[b], name, " must not decrease, got ", name, "[", b, "] = ", at[b], " > ", name,
                        "[", b + 1, "] = ", at[b + 1]);
      most = std::max<int64_t>(most, at[b + 1] - at[b]);
    }
    TORCH_CHECK_VALUE(at[n - 1] <= total, name, "[-1] = ", at[n - 1], " reaches past the ", total, " rows of ",
                      side == 0 ? "q" : "k and v");
    TORCH_CHECK_VALUE(most <= bound, side == 0 ? "max_seqlen_q" : "max_seqlen_k", " = ", bound,
                      " is less than the longest sequence of ", name, ", ", most);
    *covers &= at[0] == 0 && at[n - 1] == total;
    (side == 0 ? longest.first : longest.second) = most;
  }
  return longest;
}

void check_varlen_pages(const at::Tensor& block_table, const at::Tensor& cu_seqlens_k, int64_t page_size,
                        int64_t num_blocks) {
  const at::Tensor table = block_table.contiguous(), cu = cu_seqlens_k.contiguous();
  const int32_t *ids = table.data_ptr<int32_t>(), *at = cu.data_ptr<int32_t>();
  const int64_t max_blocks = table.size(1);
  for (int64_t b = 0; b < table.size(0); ++b) {
    const int64_t keys = at[b + 1] - at[b], blocks = (keys + page_size - 1) / page_size;
    TORCH_CHECK_VALUE(blocks <= max_blocks, "block_table: sequence ", b, " has ", keys, " keys, ", blocks,
                      " blocks of page_block_size ", page_size, ", but block_table has ", max_blocks, " columns");
    for (int64_t i = 0; i < blocks; ++i) {
      const int32_t id = ids[b * max_blocks + i];
      TORCH_CHECK_INDEX(id >= 0 && id < num_blocks, "block_table[", b, ", ", i, "] = ", id, " is not a block of the ",
                        "cache: block ids must be in [0, num_blocks = ", num_blocks, ") (sequence ", b, " reads keys ",
                        i * page_size, "..", std::min(keys, (i + 1) * page_size) - 1, " there)");
    }
  }
}

void fill_params(AttentionParams& p, const at::Tensor& q4, const at::Tensor& k4, const at::Tensor& v4, DType dtype,
                 std::optional<double> scale, const std::string& causal) {
  const int64_t d = q4.size(3), q_len = q4.size(2), kv_len = k4.size(2);
  p.q = q4.data_ptr();
  p.k = k4.data_ptr();
  p.v = v4.data_ptr();
  p.dtype = dtype;
  fill_strides(p.q_strides, q4);
  fill_strides(p.k_strides, k4);
  fill_strides(p.v_strides, v4);
  p.batch = q4.size(0);
  p.num_heads = q4.size(1);
  p.num_kv_heads = k4.size(1);
  p.q_len = q_len;
  p.kv_len = kv_len;
  p.head_dim = d;
  p.scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(d))));
  p.causal_offset = parse_causal(causal, q_len, kv_len, &p.is_causal);
}

at::Tensor fill_options(AttentionParams& p, int64_t q_len_plus_kv_len, int64_t window_left, int64_t window_right,
                        double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                        const OptionalTensor& alibi_slopes) {
  p.num_threads = std::max(1, at::get_num_threads());
  p.f32_products = g_float32_products;
  p.window_left = window_bound(window_left, q_len_plus_kv_len);
  p.window_right = window_bound(window_right, q_len_plus_kv_len);
  if (dropout_p > 0.0) {
    p.dropout_p = static_cast<float>(dropout_p);
    const at::Tensor seed = dropout_seed->contiguous();
    p.dropout_seed = static_cast<uint64_t>(seed.data_ptr<int64_t>()[0]);
    p.dropout_offset = static_cast<uint64_t>(seed.data_ptr<int64_t>()[1]);
  }
  p.softcap = static_cast<float>(softcap);
  if (!is_given(alibi_slopes)) return {};
  // (Hq,): stride 0 over the batch; else the batch's dims (q's leading dims, or a varlen call's sequences) as one.
  const at::Tensor& s = *alibi_slopes;
  at::Tensor slopes = s.dim() == 1 ? s : s.reshape({p.batch, p.num_heads});
  p.alibi_slopes = slopes.data_ptr<float>();
  p.alibi_strides[0] = s.dim() == 1 ? 0 : slopes.stride(0);
  p.alibi_strides[1] = slopes.stride(-1);
  return slopes;
}

// Fills the params of a call whose arguments check_attention has passed (it returned dtype).
Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Impl impl, DType dtype,
                 std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                 std::optional<int64_t> block_k, const OptionalTensor& attn_mask, int64_t window_left,
                 int64_t window_right, double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                 const OptionalTensor& alibi_slopes) {
  // Meta tensors pass check_attention (the fake implementations share it); the kernels need memory.
  TORCH_CHECK_VALUE(q.device().is_cpu(), "q must be on the CPU, got a tensor on ", q.device());
  const int64_t d = q.size(-1), q_len = q.size(-2), kv_len = k.size(-2);

  Prepared prep{as_4d(q, "q"), as_4d(k, "k"), as_4d(v, "v"), {}, {}};
  AttentionParams& p = prep.p;
  fill_params(p, prep.q4, prep.k4, prep.v4, dtype, scale, causal);
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
  prep.alibi = fill_options(p, q_len + kv_len, window_left, window_right, dropout_p, dropout_seed, softcap,
                            alibi_slopes);
  p.window_offset = kv_len - q_len;
  switch (impl) {
    case Impl::naive:
    case Impl::fused:
      break;
    case Impl::blocked:
      // blocked has one tile size, for both matrix multiplies: block_q, or else block_k. A tile larger than
      // every dimension is the whole matrix.
      p.block_q = p.block_k = std::min(block_q.value_or(block_k.value_or(heuristics::kBlockedTile)),
                                       std::max({q_len, kv_len, d}));
      break;
    case Impl::flash:
      // 0 lets the kernel choose its tiles (flash.cpp). Given tiles are clamped to the sequence lengths here,
      // before any kernel rounds them up to row groups or vectors: a tile beyond N is all of N (the forward
      // clamps it too; the backward's round_up(block_q, ...) would overflow near INT64_MAX).
      p.block_q = block_q ? std::min(*block_q, q_len) : 0;
      p.block_k = block_k ? std::min(*block_k, kv_len) : 0;
      break;
    case Impl::flash_teaching:  // Br x Bc, clamped to the sequences
      p.block_q = std::min(block_q.value_or(heuristics::kTeachingBlockQ), q_len);
      p.block_k = std::min(block_k.value_or(heuristics::kTeachingBlockK), kv_len);
      break;
  }
  return prep;
}

// An output of these sizes (the kernels write every element), checked before it is allocated.
at::Tensor checked_empty(at::IntArrayRef sizes, const at::TensorOptions& options, const char* name) {
  check_fits(checked_product(sizes),
             static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype()))),
             [&] { return shape_of(name, sizes); });
  return at::empty(sizes, options);
}

// ---------------------------------------------------------------------------------------------------
// attention_with_kvcache: new queries against a KV cache, contiguous or paged, with optional new keys/values
// appended in place first. The checks on sizes (symbolic: the fake implementation calls this too), then the
// checks on the data (lengths, block ids: read here, before the kernel, so no index can leave the cache).
// ---------------------------------------------------------------------------------------------------
static void check_dense(const at::Tensor& t, const char* name, int64_t dims, const char* shape) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided && !t.is_nested(), name, " must be a dense (strided) tensor");
  TORCH_CHECK_TYPE(!t.is_quantized(), name, " must not be quantized; got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dims, name, " must have shape ", shape, "; got ", t.sym_sizes());
}

// Returns the dtype of the call.
DType check_kvcache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                    const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
                    std::optional<double> scale, const OptionalTensor& cache_batch_idx,
                    const OptionalTensor& cache_leftpad, int64_t window_left, int64_t window_right, double softcap,
                    const OptionalTensor& alibi_slopes, const OptionalTensor& lse) {
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
    check_dense(*k_new, "k_new", 4, "(B, Hkv, N_new, d)");
    check_dense(*v_new, "v_new", 4, "(B, Hkv, N_new, d)");
  }
  if (paged) check_dense(*block_table, "block_table", 2, "(B, max_blocks)");
  if (is_given(cache_batch_idx)) {
    TORCH_CHECK_VALUE(!paged, "cache_batch_idx indexes the rows of a contiguous cache; a paged cache (block_table) "
                      "names each sequence's blocks instead, so pass one or the other");
    check_dense(*cache_batch_idx, "cache_batch_idx", 1, "(B,)");
  }
  if (is_given(cache_leftpad)) check_dense(*cache_leftpad, "cache_leftpad", 1, "(B,)");
  if (is_given(alibi_slopes))
    TORCH_CHECK_VALUE(alibi_slopes->dim() == 1 || alibi_slopes->dim() == 2,
                      "alibi_slopes must have shape (Hq,) or (B, Hq); got ", alibi_slopes->sym_sizes());
  if (is_given(lse)) check_dense(*lse, "lse", 3, "(B, Hq, Nq)");

  // One device: the CPU or a CUDA GPU (csrc/cuda/flash_decode.cu), or meta, for tracing.
  std::vector<std::pair<const char*, const at::Tensor*>> all = {
      {"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"cache_seqlens", &cache_seqlens}};
  if (has_k_new) {
    all.push_back({"k_new", &*k_new});
    all.push_back({"v_new", &*v_new});
  }
  if (paged) all.push_back({"block_table", &*block_table});
  if (is_given(cache_batch_idx)) all.push_back({"cache_batch_idx", &*cache_batch_idx});
  if (is_given(cache_leftpad)) all.push_back({"cache_leftpad", &*cache_leftpad});
  if (is_given(alibi_slopes)) all.push_back({"alibi_slopes", &*alibi_slopes});
  if (is_given(lse)) all.push_back({"lse", &*lse});
  const size_t tensors_of_q_dtype = has_k_new ? 6 : 4;  // q, k_cache, v_cache, cache_seqlens (skipped), k_new, v_new
  for (const auto& [name, t] : all) {
    TORCH_CHECK_VALUE(t->device().is_cpu() || t->device().is_cuda() || t->device().is_meta(),
                      "attention_with_kvcache runs on the CPU or a CUDA GPU: ", name, " is on ", t->device());
    TORCH_CHECK_VALUE(t->device() == q.device(), "q and ", name, " must be on one device, got q on ", q.device(), ", ",
                      name, " on ", t->device());
  }

  const DType dtype = parse_dtype(q, Impl::flash);
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& [name, t] = all[i];
    if (t == &cache_seqlens || i >= tensors_of_q_dtype) continue;
    TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type(), name, " must have q's dtype, ", q.scalar_type(), "; got ",
                     t->scalar_type());
  }
  TORCH_CHECK_TYPE(cache_seqlens.scalar_type() == at::kInt || cache_seqlens.scalar_type() == at::kLong,
                   "cache_seqlens must be int32 or int64, got ", cache_seqlens.scalar_type());
  if (paged)
    TORCH_CHECK_TYPE(block_table->scalar_type() == at::kInt, "block_table must be int32, got ",
                     block_table->scalar_type());
  for (const auto& [name, t] : {std::pair{"cache_batch_idx", &cache_batch_idx}, std::pair{"cache_leftpad", &cache_leftpad}})
    if (is_given(*t))
      TORCH_CHECK_TYPE((*t)->scalar_type() == at::kInt, name, " must be int32, got ", (*t)->scalar_type());
  if (is_given(alibi_slopes))
    TORCH_CHECK_TYPE(alibi_slopes->scalar_type() == at::kFloat, "alibi_slopes must be float32, got ",
                     alibi_slopes->scalar_type());
  if (is_given(lse))
    TORCH_CHECK_TYPE(lse->scalar_type() == at::kFloat, "lse must be float32, got ", lse->scalar_type());

  const c10::SymInt B = q.sym_size(0), Hq = q.sym_size(1), Nq = q.sym_size(2), d = q.sym_size(3);
  const c10::SymInt Hkv = k_cache.sym_size(1);
  CHECK_SIZES(d.sym_ge(1), "head dim d (the last dim of q) must be >= 1, got q of shape ", q.sym_sizes());
  CHECK_SIZES(Nq.sym_ge(1), "q must have at least one query row (dim 2), got shape ", q.sym_sizes());
  if (q.device().is_cuda())  // the CUDA decode kernel's rows are whole 16-byte loads per lane (flash_decode.cu)
    CHECK_SIZES(d.sym_eq(64).sym_or(d.sym_eq(128)), "attention_with_kvcache on CUDA takes head dim d = 64 or 128, "
                "got q of shape ", q.sym_sizes(), " (other head dims run on the CPU)");
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
  } else if (is_given(cache_batch_idx)) {
    CHECK_SIZES(cache_batch_idx->sym_size(0).sym_eq(B), "cache_batch_idx must have shape (B,) = (", B,
                ",) (a cache row per sequence of q), got ", cache_batch_idx->sym_sizes());
  } else {
    CHECK_SIZES(k_cache.sym_size(0).sym_eq(B), "k_cache must have shape (B, Hkv, max_len, d) with B = ", B,
                " (q's batch), got ", k_cache.sym_sizes(), " (a paged cache needs block_table; other rows, cache_batch_idx)");
  }
  if (is_given(cache_leftpad))
    CHECK_SIZES(cache_leftpad->sym_size(0).sym_eq(B), "cache_leftpad must have shape (B,) = (", B,
                ",) (one start per sequence of q), got ", cache_leftpad->sym_sizes());
  if (has_k_new) {
    const c10::SymInt N_new = k_new->sym_size(2);
    const std::vector<c10::SymInt> expected = {B, Hkv, N_new, d};
    for (const auto& [name, t] : {std::pair{"k_new", &*k_new}, std::pair{"v_new", &*v_new}})
      CHECK_SIZES(equal_sizes(t->sym_sizes(), expected), name, " must have shape (B, Hkv, N_new, d) = ",
                  c10::SymIntArrayRef(expected), " (N_new from k_new), got ", t->sym_sizes());
  }
  if (is_given(alibi_slopes)) {
    const bool per_batch = alibi_slopes->dim() == 2;
    CHECK_SIZES(per_batch ? alibi_slopes->sym_size(0).sym_eq(B).sym_and(alibi_slopes->sym_size(1).sym_eq(Hq))
                          : alibi_slopes->sym_size(0).sym_eq(Hq),
                "alibi_slopes must have shape (Hq,) = (", Hq, ",) or (B, Hq) = (", B, ", ", Hq, "); got ",
                alibi_slopes->sym_sizes());
  }
  if (is_given(lse)) {
    const std::vector<c10::SymInt> expected = {B, Hq, Nq};
    CHECK_SIZES(equal_sizes(lse->sym_sizes(), expected), "lse must have shape (B, Hq, Nq) = ",
                c10::SymIntArrayRef(expected), ", got ", lse->sym_sizes());
    CHECK_SIZES(lse->sym_is_contiguous(), "lse must be contiguous (it is written in place), got strides ",
                lse->sym_strides());
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
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1, "window must be (left, right) with each >= 0, or -1 "
                    "for no bound on that side; got (", window_left, ", ", window_right, ")");
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0 && softcap < kFloat32Overflow,
                    "softcap must be a finite float32 >= 0 (0: none), got ", softcap);
  return dtype;
}

// Appending into a paged cache: each row that k_new and v_new are written to must be seen by the sequence that writes
// it, and by no other. Block tables may share a block (a common prefix), but a row that one sequence appends and
// another sees (or appends too) would give that other sequence a key that is not its own; so would a table naming
// one block twice, the appended row then seen at a second position. lengths[b] counts the new rows too. One more pass
// over the block ids the call reads (as the bounds check does), with a mark per cache block (kept from call to call,
// cleared after each): with the bounds check, 0.4 % of a 64-sequence paged decode's time (2-core EPYC, perf).
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

// ---- merge_partial_ ----
DType check_merge(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& out_block,
                  const at::Tensor& lse_block) {
  check_tensor(out, "out");
  check_tensor(out_block, "out_block");
  check_plain(lse, "lse");  // (its rank: the shape check below names the one expected)
  check_plain(lse_block, "lse_block");
  check_devices({{"out", &out}, {"lse", &lse}, {"out_block", &out_block}, {"lse_block", &lse_block}});
  TORCH_CHECK_VALUE(out.dim() == 4, "out must have shape (batch, heads, rows, head_dim), 4 dims; got shape ",
                    out.sym_sizes());
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, "out must be float32 (the running result), got ",
                   out.scalar_type());
  const at::ScalarType t = out_block.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
                   "out_block must be float32, bfloat16 or float16, got ", t);
  CHECK_SIZES(equal_sizes(out_block.sym_sizes(), out.sym_sizes()), "out_block must have the shape of out, ",
              out.sym_sizes(), "; got ", out_block.sym_sizes());
  const auto rows_shape = out.sym_sizes().slice(0, 3);
  for (const auto& [name, l] : {std::pair{"lse", &lse}, std::pair{"lse_block", &lse_block}}) {
    TORCH_CHECK_TYPE(l->scalar_type() == at::kFloat, name, " must be float32, got ", l->scalar_type());
    CHECK_SIZES(equal_sizes(l->sym_sizes(), rows_shape), name, " must have shape (batch, heads, rows) ",
                rows_shape, " (out's without head_dim); got ", l->sym_sizes());
  }
  for (const auto& [name, o] : {std::pair{"out", &out}, std::pair{"out_block", &out_block}})
    CHECK_SIZES(o->sym_size(3).sym_eq(1).sym_or(o->sym_stride(3).sym_eq(1)), name,
                " must have a contiguous last dim (stride 1), got strides ", o->sym_strides());
  // Written in place: no two elements may share memory (an expanded view), as torch refuses for its in-place ops.
  for (const auto& [name, w] : {std::pair{"out", &out}, std::pair{"lse", &lse}})
    TORCH_CHECK_VALUE(at::has_internal_overlap(*w) != at::MemOverlap::Yes, name,
                      " has elements that share memory (an expanded view: strides ", w->sym_strides(),
                      "), so it cannot be written in place");
  return t == at::kFloat ? DType::f32 : t == at::kBFloat16 ? DType::bf16 : DType::f16;
}

MergeParams merge_params(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& out_block,
                         const at::Tensor& lse_block, DType dtype) {
  // Rows run in parallel: an input sharing memory with another row's output would be read after that row is written
  // (the same tensor passed twice, each row its own, is fine). Decided on real tensors only (fakes have no memory).
  using Pair = std::tuple<const char*, const at::Tensor*, const char*, const at::Tensor*, bool>;
  for (const auto& [a, ta, b, tb, full_ok] : {Pair{"out", &out, "out_block", &out_block, true},
                                              Pair{"lse", &lse, "lse_block", &lse_block, true},
                                              Pair{"out", &out, "lse", &lse, false},
                                              Pair{"out", &out, "lse_block", &lse_block, false},
                                              Pair{"lse", &lse, "out_block", &out_block, false}}) {
    const at::MemOverlapStatus o = at::get_overlap_status(*ta, *tb);
    TORCH_CHECK_VALUE(o == at::MemOverlapStatus::No || o == at::MemOverlapStatus::TooHard ||
                          (full_ok && o == at::MemOverlapStatus::Full),
                      a, " and ", b, " share memory", full_ok ? " in part" : "", "; ", a,
                      " is written in place, so pass ", b, full_ok ? " as the same tensor or" : "",
                      " in memory of its own (.clone())");
  }
  MergeParams mp;
  mp.out = out.data_ptr<float>();
  mp.lse = lse.data_ptr<float>();
  mp.out_b = out_block.data_ptr();
  mp.lse_b = lse_block.const_data_ptr<float>();
  mp.dtype = dtype;
  mp.batch = out.size(0), mp.heads = out.size(1), mp.rows = out.size(2), mp.head_dim = out.size(3);
  for (int i = 0; i < 3; ++i) {
    mp.out_strides[i] = out.stride(i), mp.out_b_strides[i] = out_block.stride(i);
    mp.lse_strides[i] = lse.stride(i), mp.lse_b_strides[i] = lse_block.stride(i);
  }
  return mp;
}

}  // namespace cs149gpt
