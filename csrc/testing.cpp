// The module's testing corner, cs149gpt._C._testing: knobs and probes that exist for tests and measurements, not
// for users. Forcing the instruction set or the backward's path, the vectorised exp, the dropout mask and the mask
// scan as the kernels see them, the FMA / bf16 peak and read-bandwidth probes.
#include "testing.h"

#include <pybind11/stl.h>
#include <torch/extension.h>

#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention.h"
#include "checks.h"
#include "mask_ranges.h"

namespace cs149gpt {
namespace testing {

heuristics::BackwardForce backward_force;

namespace {

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

// tanh of every element of a float32 tensor, by the current ISA's vectorised tanh (softcap's; a test hook).
at::Tensor vector_tanh(const at::Tensor& x) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  at::Tensor y = x.contiguous().clone();
  kernels().tanh_row(y.data_ptr<float>(), y.numel());
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

void register_testing(pybind11::module_& m) {
  namespace py = pybind11;
  py::module_ t = m.def_submodule("_testing", "knobs and probes for tests and measurements (not a stable API)");
  t.def("dropout_keep_mask", [](int64_t seed, int64_t offset, std::vector<int64_t> shape, double p) {
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
  t.def("key_ranges_of", [](const at::Tensor& mask, const at::Tensor& q, int64_t kv_len) -> py::object {
    const KeyRanges runs = key_ranges_of(mask_as_4d(mask, q, kv_len));
    return runs.ranges.defined() ? py::make_tuple(runs.ranges, runs.plain) : py::object(py::none());
  }, "An attn_mask's (first, end) run of shown keys per distinct row, as the flash kernels receive it, and whether the "
     "runs add nothing (the mask is then not read); None if a row shows two runs or more, or the mask is left to the "
     "kernels unscanned (tests)");
  t.def("set_isa", &set_isa_checked,
        "force the kernels' instruction set (amx, avx512_bf16, avx512, avx2, scalar; amx_emulated for tests)");
  t.def("set_backward_path", [](const std::string& path) {
    TORCH_CHECK_VALUE(path == "auto" || path == "one_pass" || path == "two_pass",
                      "path must be 'auto', 'one_pass' or 'two_pass'; got '", path, "'");
    backward_force.path = path == "auto" ? -1 : path == "one_pass" ? 1 : 0;
  }, "force the flash backward's algorithm ('one_pass', 'two_pass'), or let the shape decide ('auto', the default)");
  t.def("backward_path", [] {
    return std::string(backward_force.path < 0 ? "auto" : backward_force.path == 1 ? "one_pass" : "two_pass");
  }, "the flash backward's algorithm setting (set_backward_path)");
  t.def("set_backward_key_chunks", [](int64_t chunks) {
    TORCH_CHECK_VALUE(chunks >= 0 && chunks <= 8, "chunks must be in [0, 8] (0: decided by shape), got ", chunks);
    backward_force.key_chunks = chunks;
  }, "force the one-pass backward to split each kv head's keys into this many tasks (0: decided by shape)");
  t.def("set_backward_head_parts", [](int64_t parts) {
    TORCH_CHECK_VALUE(parts >= 0 && parts <= 64, "parts must be in [0, 64] (0: decided by shape), got ", parts);
    backward_force.head_parts = parts;
  }, "force the float32 one-pass backward to split each kv head's query heads into this many parts (its greatest "
     "common divisor with the group size; 0: decided by shape)");
  t.def("fma_peak_gflops", &fma_peak_gflops, py::arg("num_threads") = 1, py::arg("seconds") = 0.2,
        py::call_guard<py::gil_scoped_release>(),
        "measured FMA peak in GFLOP/s of the current ISA's vectors on num_threads threads");
  t.def("bf16_peak_gflops", &bf16_peak_gflops, py::arg("num_threads") = 1, py::arg("seconds") = 0.2,
        py::call_guard<py::gil_scoped_release>(),
        "measured bf16 dot-product peak in GFLOP/s (AMX or vdpbf16ps) on num_threads threads; None without one");
  t.def("read_probe", &read_probe, py::arg("x"), py::arg("num_threads") = 1, py::call_guard<py::gil_scoped_release>(),
        "sum of a float32 tensor read with vector loads on num_threads threads (time it: read bandwidth)");
  t.def("vector_exp", &vector_exp, "exp by the kernels' vectorised exp (current ISA), for tests");
  t.def("vector_exp2", &vector_exp2, "2^x by the kernels' vectorised 2^x (current ISA), for tests");
  t.def("vector_tanh", &vector_tanh, "tanh by the kernels' vectorised tanh (current ISA; softcap's), for tests");
  t.def("cpu_supports", [](const std::string& name) { return cpu_supports(name.c_str()); },
        "whether this CPU runs the kernels of the named instruction set");
  t.def("amx_emulation_restores_tile_config", [] {
        TORCH_CHECK_NOT_IMPLEMENTED(cpu_supports("amx_emulated"),
                                    "amx_emulation_restores_tile_config needs a CPU that runs amx_emulated "
                                    "(AVX512-BF16)");
        return amx_emulated::restores_tile_config();
      },
        "tests: under emulated tiles, a foreign tile configuration is back after one of our bf16 products, and none "
        "is left where there was none");
}

}  // namespace testing
}  // namespace cs149gpt
