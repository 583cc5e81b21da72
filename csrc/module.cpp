// The Python face of the kernels: argument checks, shape decisions and bindings. Nothing else.
//
// Every check happens here, before a kernel runs, and fails with a Python exception that names the
// argument and what was expected. Then one AttentionParams (pointers, strides, sizes) is filled and
// handed to the kernel of the ISA chosen at load time (dispatch.cpp). Kernels never see a Tensor.
#include <torch/extension.h>
#include <torch/library.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <cmath>
#include <optional>
#include <string>

#include "attention.h"

namespace cs149gpt {
namespace {

// Default tile sizes, measured on the 2-core dev box with benchmarks/bench_attention.py (see README).
constexpr int64_t kDefaultBlockedTile = 64;
constexpr int64_t kDefaultFlashBlockQ = 64;
constexpr int64_t kDefaultFlashBlockK = 128;

enum class Impl { naive, blocked, fused, flash };

Impl parse_impl(const std::string& impl) {
  if (impl == "naive") return Impl::naive;
  if (impl == "blocked") return Impl::blocked;
  if (impl == "fused") return Impl::fused;
  if (impl == "flash") return Impl::flash;
  TORCH_CHECK_VALUE(false, "impl must be one of 'naive', 'blocked', 'fused', 'flash'; got '", impl, "'");
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

// Scratch for the N×N score matrix of naive and blocked; refused up front when it cannot fit.
at::Tensor score_matrix(int64_t q_len, int64_t kv_len, const char* impl) {
  int64_t elems = 0;
  const bool overflow = __builtin_mul_overflow(q_len, kv_len, &elems);
  const double gib = static_cast<double>(q_len) * static_cast<double>(kv_len) * sizeof(float) / (1 << 30);
  TORCH_CHECK_WITH(OutOfMemoryError, !overflow && elems * static_cast<double>(sizeof(float)) <= physical_memory_bytes(),
                   "impl='", impl, "' materialises the q_len x kv_len score matrix (", q_len, " x ", kv_len,
                   " floats = ", gib, " GiB), more than this machine's memory; use impl='fused' or 'flash', "
                   "which need O(N) memory");
  return at::empty({q_len, kv_len}, at::TensorOptions().dtype(at::kFloat));
}

int64_t positive_block(std::optional<int64_t> block, const char* name, int64_t fallback) {
  if (block) TORCH_CHECK_VALUE(*block >= 1, name, " must be >= 1, got ", *block);
  return block.value_or(fallback);
}

}  // namespace

// attention(q, k, v, impl, scale, is_causal, block_q, block_k) -> out
//   q: (..., Nq, d); k, v: (..., Nk, d) with the same leading dims, except that the head dim (-3) of k and v
//   may divide q's (grouped-query attention). out: (..., Nq, d), contiguous.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& impl_name,
                     std::optional<double> scale, bool is_causal, std::optional<int64_t> block_q,
                     std::optional<int64_t> block_k) {
  const Impl impl = parse_impl(impl_name);
  check_input(q, "q");
  check_input(k, "k");
  check_input(v, "v");
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat, "q must be float32, got ", q.scalar_type());
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
  TORCH_CHECK_VALUE(std::isfinite(scale_value), "scale must be finite, got ", scale_value);

  const at::Tensor q4 = as_4d(q), k4 = as_4d(k), v4 = as_4d(v);
  at::Tensor out = at::empty({q4.size(0), q4.size(1), q_len, d}, q.options());

  AttentionParams p;
  p.q = q4.data_ptr<float>();
  p.k = k4.data_ptr<float>();
  p.v = v4.data_ptr<float>();
  p.out = out.data_ptr<float>();
  fill_strides(p.q_strides, q4);
  fill_strides(p.k_strides, k4);
  fill_strides(p.v_strides, v4);
  fill_strides(p.out_strides, out);
  p.batch = q4.size(0);
  p.num_heads = q4.size(1);
  p.num_kv_heads = k4.size(1);
  p.q_len = q_len;
  p.kv_len = kv_len;
  p.head_dim = d;
  p.scale = static_cast<float>(scale_value);
  p.is_causal = is_causal;
  p.causal_offset = 0;

  if (p.batch * p.num_heads > 0) {
    const KernelTable& kernels = cs149gpt::kernels();
    switch (impl) {
      case Impl::naive:
        kernels.naive(p, score_matrix(q_len, kv_len, "naive").data_ptr<float>());
        break;
      case Impl::blocked: {
        // blocked has one tile size, for both matrix multiplies: block_q, or else block_k.
        p.block_q = p.block_k = positive_block(block_q ? block_q : block_k, block_q ? "block_q" : "block_k",
                                               kDefaultBlockedTile);
        kernels.blocked(p, score_matrix(q_len, kv_len, "blocked").data_ptr<float>());
        break;
      }
      case Impl::fused:
        kernels.fused(p);
        break;
      case Impl::flash:
        // Tiles larger than the sequence are the whole sequence: scratch stays O(N).
        p.block_q = std::min(positive_block(block_q, "block_q", kDefaultFlashBlockQ), q_len);
        p.block_k = std::min(positive_block(block_k, "block_k", kDefaultFlashBlockK), kv_len);
        kernels.flash(p);
        break;
    }
  }
  return out.view(q.sizes());
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
  return attention(Q, K, V, impl, 1.0, false, block_q, block_k);
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
  m.def("attention(Tensor q, Tensor k, Tensor v, str impl='flash', float? scale=None, bool is_causal=False, "
        "int? block_q=None, int? block_k=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(cs149gpt, CPU, m) { m.impl("attention", &cs149gpt::attention); }

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
  m.def("isa", &isa, "the instruction set the kernels run with: avx512, avx2 or scalar");
  m.def("set_isa", &set_isa_checked, "force the kernels' instruction set (avx512, avx2 or scalar)");
  m.def("cpu_supports", [](const std::string& name) { return cpu_supports(name.c_str()); },
        "whether this CPU runs the kernels of the named instruction set");
}
