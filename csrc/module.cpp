// The Python face of the kernels: argument checks, shape decisions and bindings. Nothing else.
//
// Every check happens here, before a kernel runs, and fails with a Python exception that names the
// argument and what was expected. Then one AttentionParams (pointers, strides, sizes) is filled and
// handed to the kernel of the ISA chosen at load time (dispatch.cpp). Kernels never see a Tensor.
#include <torch/extension.h>
#include <torch/library.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <optional>
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
      TORCH_CHECK_TYPE(impl == Impl::flash, "impl='", impl == Impl::naive ? "naive" : impl == Impl::blocked ? "blocked" : "fused",
                       "' supports float32 only, got ", q.scalar_type(), "; impl='flash' takes bfloat16 and float16");
      return q.scalar_type() == at::kBFloat16 ? DType::bf16 : DType::f16;
    default:
      TORCH_CHECK_TYPE(false, "q must be float32, bfloat16 or float16, got ", q.scalar_type());
  }
}

void check_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU, got a tensor on ", t.device());
  TORCH_CHECK_VALUE(t.dim() >= 2, name, " must have shape (..., N, d), at least 2 dims; got shape ", t.sizes());
}

// (..., N, d) as (batch, heads, N, d): a view for 2-, 3- and 4-D; leading dims beyond two are flattened
// into the batch, which is a view too whenever their strides allow it.
at::Tensor as_4d(const at::Tensor& t) {
  at::Tensor t4;
  switch (t.dim()) {
    case 2: t4 = t.unsqueeze(0).unsqueeze(0); break;
    case 3: t4 = t.unsqueeze(0); break;
    case 4: t4 = t; break;
    default: t4 = t.flatten(0, t.dim() - 4);
  }
  // The one copy we ever make: SIMD loads need the head_dim columns contiguous.
  if (t4.size(3) > 1 && t4.stride(3) != 1) t4 = t4.contiguous();
  return t4;
}

void fill_strides(int64_t (&strides)[3], const at::Tensor& t4) {
  for (int i = 0; i < 3; ++i) strides[i] = t4.stride(i);
}

int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size : INT64_MAX;
}

// naive and blocked materialise the q_len × kv_len score matrix: refuse up front when it cannot fit.
void check_score_matrix_fits(int64_t q_len, int64_t kv_len, const char* impl) {
  int64_t elems = 0;
  const bool overflow = __builtin_mul_overflow(q_len, kv_len, &elems);
  const double gib = static_cast<double>(q_len) * static_cast<double>(kv_len) * sizeof(float) / (1 << 30);
  TORCH_CHECK_WITH(OutOfMemoryError, !overflow && elems * static_cast<double>(sizeof(float)) <= physical_memory_bytes(),
                   "impl='", impl, "' materialises the q_len x kv_len score matrix (", q_len, " x ", kv_len,
                   " floats = ", gib, " GiB), more than this machine's memory; use impl='fused' or 'flash', "
                   "which need O(N) memory");
}

// q, k, v checked and seen as (batch, heads, N, d), with the params of a call on them (all but out and lse).
struct Prepared {
  at::Tensor q4, k4, v4;  // views (or, for a strided last dim, copies) that the params point into
  AttentionParams p;
};

// Checks every argument of an attention call and fills the params.
Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Impl impl,
                 std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                 std::optional<int64_t> block_k) {
  check_input(q, "q");
  check_input(k, "k");
  check_input(v, "v");
  const DType dtype = parse_dtype(q, impl);
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "q, k and v must share one dtype, got q ", q.scalar_type(), ", k ", k.scalar_type(), ", v ",
                   v.scalar_type());
  TORCH_CHECK_VALUE(k.dim() == q.dim() && v.dim() == q.dim(), "q, k and v must have the same number of dims, got q ",
                    q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  const int64_t rank = q.dim();
  const int64_t d = q.size(-1), q_len = q.size(-2), kv_len = k.size(-2);
  TORCH_CHECK_VALUE(d >= 1, "head dim d (the last dim of q) must be >= 1, got q of shape ", q.sizes());
  TORCH_CHECK_VALUE(q_len >= 1, "q must have at least one query row (dim -2), got shape ", q.sizes());
  TORCH_CHECK_VALUE(kv_len >= 1, "k must have at least one key row (dim -2), got shape ", k.sizes());
  TORCH_CHECK_VALUE(k.size(-1) == d && v.size(-1) == d, "k and v must have head dim d = ", d,
                    " (the last dim of q), got k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK_VALUE(v.size(-2) == kv_len, "k and v must have the same length (dim -2), got k ", k.sizes(), ", v ",
                    v.sizes());
  for (int64_t i = 0; i + 3 < rank; ++i)
    TORCH_CHECK_VALUE(k.size(i) == q.size(i) && v.size(i) == q.size(i), "q, k and v must have the same leading dims, "
                      "got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  if (rank >= 3) {
    const int64_t hq = q.size(-3), hkv = k.size(-3);
    TORCH_CHECK_VALUE(v.size(-3) == hkv, "k and v must have the same number of heads (dim -3), got k ", k.sizes(),
                      ", v ", v.sizes());
    TORCH_CHECK_VALUE(hkv >= 1 && hq % hkv == 0, "the heads of q (dim -3) must be a multiple of those of k and v, "
                      "got q ", q.sizes(), ", k ", k.sizes());
  }
  const double scale_value = scale.value_or(1.0 / std::sqrt(static_cast<double>(d)));
  TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(scale_value)), "scale must be a finite float32, got ",
                    scale_value);
  // Tile sizes are checked whatever the impl, so a typo is never silently ignored.
  if (block_q) TORCH_CHECK_VALUE(*block_q >= 1, "block_q must be >= 1, got ", *block_q);
  if (block_k) TORCH_CHECK_VALUE(*block_k >= 1, "block_k must be >= 1, got ", *block_k);

  Prepared prep{as_4d(q), as_4d(k), as_4d(v), {}};
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
      // 0 lets the kernel choose its tiles (flash.cpp); it clamps them to the sequence lengths.
      p.block_q = block_q.value_or(0);
      p.block_k = block_k.value_or(0);
      break;
  }
  return prep;
}

// A kernel's workspace, through torch's allocator: the profiler counts it, and a failure is a Python exception.
at::Tensor workspace(int64_t floats) { return at::empty({floats}, at::TensorOptions().dtype(at::kFloat)); }

// Runs one forward kernel. Returns (out, lse); lse is defined only when asked for (flash only).
std::tuple<at::Tensor, at::Tensor> run_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 Impl impl, std::optional<double> scale, const std::string& causal,
                                                 std::optional<int64_t> block_q, std::optional<int64_t> block_k,
                                                 bool want_lse) {
  TORCH_CHECK_VALUE(!want_lse || impl == Impl::flash, "lse is computed by impl='flash' only");
  Prepared prep = prepare(q, k, v, impl, scale, causal, block_q, block_k);
  AttentionParams& p = prep.p;
  at::Tensor out = at::empty({p.batch, p.num_heads, p.q_len, p.head_dim}, q.options());
  p.out = out.data_ptr();
  fill_strides(p.out_strides, out);
  at::Tensor lse;
  if (want_lse) {
    lse = at::empty({p.batch, p.num_heads, p.q_len}, q.options().dtype(at::kFloat));
    p.lse = lse.data_ptr<float>();
    p.lse_strides[0] = lse.stride(0);
    p.lse_strides[1] = lse.stride(1);
  }

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
  if (p.batch * p.num_heads > 0) kernel->run(p, workspace(kernel->workspace_floats(p)).data_ptr<float>());
  const auto lead = q.sizes().slice(0, q.dim() - 1);
  return {out.view(q.sizes()), want_lse ? lse.view(lead) : lse};
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name) {
  TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), name, " must have the shape of ", like_name, ", ", like.sizes(),
                    "; got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have the dtype of ", like_name, ", ",
                   like.scalar_type(), "; got ", t.scalar_type());
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

// flash_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k) -> (dq, dk, dv)
//   The gradients of flash_attention's out with respect to q, k, v, given dout = ∂L/∂out and the forward's
//   out and lse; P is recomputed tile by tile from lse (flash_backward.cpp). dk, dv have k's and v's shape.
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
    std::optional<int64_t> block_k) {
  Prepared prep = prepare(q, k, v, Impl::flash, scale, causal, block_q, block_k);
  check_like(dout, "dout", q, "q");
  check_like(out, "out", q, "q");
  TORCH_CHECK_VALUE(lse.defined() && lse.sizes() == q.sizes().slice(0, q.dim() - 1), "lse must have shape ",
                    q.sizes().slice(0, q.dim() - 1), " (q's without the last dim); got ",
                    lse.defined() ? lse.sizes() : at::IntArrayRef{});
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, "lse must be float32, got ", lse.scalar_type());

  AttentionBackwardParams bp;
  bp.fwd = prep.p;
  const at::Tensor dout4 = as_4d(dout), out4 = as_4d(out);
  const at::Tensor lse3 = lse.reshape({bp.fwd.batch, bp.fwd.num_heads, bp.fwd.q_len}).contiguous();
  bp.fwd.out = out4.data_ptr();
  fill_strides(bp.fwd.out_strides, out4);
  bp.fwd.lse = const_cast<float*>(lse3.data_ptr<float>());
  bp.fwd.lse_strides[0] = lse3.stride(0);
  bp.fwd.lse_strides[1] = lse3.stride(1);
  bp.dout = dout4.data_ptr();
  fill_strides(bp.dout_strides, dout4);
  at::Tensor dq = at::empty(prep.q4.sizes(), q.options()), dk = at::empty(prep.k4.sizes(), k.options()),
             dv = at::empty(prep.v4.sizes(), v.options());
  bp.dq = dq.data_ptr();
  bp.dk = dk.data_ptr();
  bp.dv = dv.data_ptr();
  fill_strides(bp.dq_strides, dq);
  fill_strides(bp.dk_strides, dk);
  fill_strides(bp.dv_strides, dv);
  if (bp.fwd.batch * bp.fwd.num_heads > 0) {
    const BackwardKernel& kernel = kernels().flash_backward;
    kernel.run(bp, workspace(kernel.workspace_floats(bp)).data_ptr<float>());
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

// tensor[x][y] of a row-major 2-D array of row length sizeX, flattened into a list.
float twoDimRead(const std::vector<float>& tensor, int64_t x, int64_t y, int64_t sizeX) {
  TORCH_CHECK_VALUE(sizeX >= 1, "sizeX must be >= 1, got ", sizeX);
  TORCH_CHECK_INDEX(x >= 0 && y >= 0 && y < sizeX, "twoDimRead index (", x, ", ", y, ") is outside rows of ", sizeX);
  const int64_t index = x * sizeX + y;
  TORCH_CHECK_INDEX(index < static_cast<int64_t>(tensor.size()), "twoDimRead index (", x, ", ", y, ") -> ", index,
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
  const int64_t index = ((x * sizeX + y) * sizeY + z) * sizeZ + b;
  TORCH_CHECK_INDEX(index < static_cast<int64_t>(tensor.size()), "fourDimRead index (", x, ", ", y, ", ", z, ", ", b,
                    ") -> ", index, " is past the end of a list of ", tensor.size());
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
double fma_peak_gflops(int64_t num_threads, double seconds) {
  TORCH_CHECK_VALUE(num_threads >= 1, "num_threads must be >= 1, got ", num_threads);
  const auto probe = kernels().fma_probe;
  int64_t iterations = 1 << 16;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    const double flops = probe(iterations, static_cast<int>(num_threads));
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed >= seconds) return flops / elapsed * 1e-9;
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
  m.def("isa", &isa, "the instruction set the kernels run with: amx, avx512_bf16, avx512, avx2 or scalar");
  m.def("set_isa", &set_isa_checked, "force the kernels' instruction set (amx, avx512_bf16, avx512, avx2, scalar)");
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
