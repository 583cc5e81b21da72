// The CUDA face of the operators: checks, shape decisions, launches. The only CUDA file that touches a Tensor.
//
// The same three operators as csrc/module.cpp (schemas declared there, once), registered for the CUDA
// dispatch key, so autograd, fake tensors and torch.compile (cs149gpt/ops.py) work unchanged:
//   attention / flash_attention     impl="flash" only (the other rungs are CPU teaching kernels):
//       bfloat16, float16 -> FlashAttention-2 on tensor cores (flash_fwd.cuh), head_dim 64 or 128, sm_80+;
//       float32           -> the teaching kernel, one thread per query row (flash_teaching.cu), any head_dim
//                            whose tiles fit in shared memory; block_q x block_k is its Br x Bc.
//   flash_attention_backward        bfloat16, float16 (flash_bwd.cuh).
// The argument checks are the CPU ops' own (checks.h: the same function, so the same words); this file adds only
// the GPU's limits.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>

#include "../attention.h"
#include "../checks.h"
#include "../heuristics.h"
#include "flash_cuda.h"

namespace cs149gpt {
namespace cuda {
namespace {

// Br (threads per block) x Bc: the CPU teaching kernel's defaults (heuristics.h).
constexpr int64_t kTeachingBlockQ = heuristics::kTeachingBlockQ, kTeachingBlockK = heuristics::kTeachingBlockK;

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "cs149gpt: launching the CUDA ", what, " failed: ", cudaGetErrorString(err));
}

// An on/off switch from the environment (benchmarks compare both sides in one run): unset -> default_value.
bool config_flag(const char* name, bool default_value) {
  const char* value = std::getenv(name);
  return value == nullptr || *value == '\0' ? default_value : std::string(value) != "0";
}

int device_attribute(cudaDeviceAttr attr, int device) {
  int value = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&value, attr, device);
  TORCH_CHECK(err == cudaSuccess, "cs149gpt: cudaDeviceGetAttribute failed: ", cudaGetErrorString(err));
  return value;
}

// (..., N, d) as (batch, heads, N, d), a view where strides allow. The tensor-core kernels copy rows with
// 16-byte loads: a last dim that is not contiguous, or rows, heads or batches not 16-byte aligned, are the
// cases where a copy is made.
at::Tensor as_4d_aligned(const at::Tensor& t, bool aligned_rows) {
  at::Tensor t4;
  switch (t.dim()) {
    case 2: t4 = t.unsqueeze(0).unsqueeze(0); break;
    case 3: t4 = t.unsqueeze(0); break;
    case 4: t4 = t; break;
    default: t4 = t.flatten(0, t.dim() - 4);
  }
  if (t4.size(3) > 1 && t4.stride(3) != 1) t4 = t4.contiguous();
  if (aligned_rows) {
    const int64_t vec = 16 / static_cast<int64_t>(t4.element_size());
    bool ok = reinterpret_cast<uintptr_t>(t4.data_ptr()) % 16 == 0;
    for (int i = 0; i < 3; ++i) ok = ok && (t4.size(i) == 1 || t4.stride(i) % vec == 0);
    if (!ok) t4 = t4.contiguous();
  }
  return t4;
}

struct Prepared {
  at::Tensor q4, k4, v4;
  AttentionParams p;
  bool fast;  // tensor cores (bf16/f16) rather than the teaching kernel (f32)
  at::Tensor mask4, key_bounds, alibi;  // what p.mask, p.key_ranges, p.alibi_slopes point into
};

// The params of a call whose arguments the shared checks passed (they returned dtype), after the GPU's own limits.
Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, DType dtype,
                 std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                 std::optional<int64_t> block_k) {
  const at::ScalarType st = q.scalar_type();
  const int64_t d = q.size(-1), q_len = q.size(-2), kv_len = k.size(-2);
  const bool fast = st != at::kFloat;
  const int device = q.device().index();
  if (fast) {
    const int major = device_attribute(cudaDevAttrComputeCapabilityMajor, device);
    TORCH_CHECK(major >= 8, "CUDA flash attention in ", c10::toString(st),
                " needs a GPU of compute capability 8.0 or newer "
                "(tensor-core mma.sync, cp.async); this one is ", major, ".x");
  }

  Prepared prep{as_4d_aligned(q, fast), as_4d_aligned(k, fast), as_4d_aligned(v, fast), {}, fast};
  AttentionParams& p = prep.p;
  fill_params(p, prep.q4, prep.k4, prep.v4, dtype, scale, causal);
  TORCH_CHECK_VALUE(p.batch * p.num_heads <= 65535, "CUDA flash attention takes at most 65535 (batch x heads), got ",
                    p.batch * p.num_heads);
  if (!fast) {
    // The teaching kernel: Br threads, each a query row; tiles clamped to the sequences; they must fit in
    // shared memory.
    p.block_q = std::min<int64_t>(block_q.value_or(kTeachingBlockQ), std::min<int64_t>(q_len, 1024));
    p.block_k = std::min<int64_t>(block_k.value_or(kTeachingBlockK), kv_len);
    const size_t smem_limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (!block_q && !block_k)
      while (teaching_smem_bytes(p) > smem_limit && p.block_k > 1) p.block_k /= 2;
    TORCH_CHECK_VALUE(teaching_smem_bytes(p) <= smem_limit, "the float32 teaching kernel's tiles "
                      "(block_q ", p.block_q, " x block_k ", p.block_k, ", d = ", d, ") need ", teaching_smem_bytes(p),
                      " bytes of shared memory, more than this GPU's ", smem_limit,
                      "; pass smaller block_q / block_k");
  }
  return prep;
}

// attn_mask, window, dropout, softcap and ALiBi into the params (the tensor-core kernels' general path; checks.cpp
// refuses them for float32, the teaching kernel). attn_mask is read in place (expanded: stride 0 where broadcast), and
// its rows' key bounds are found on the GPU (mask_key_bounds) so that the kernels skip the tiles outside them, and
// read no entry of a row that shows one run of keys adding nothing (padding, padded causal masks). The
// dropout seed tensor is read on the host (checks.cpp: an int64 CPU tensor, as the CPU ops take it), so the same
// (seed, offset) drops the same elements on both devices.
void fill_features(Prepared& prep, const at::Tensor& q, const OptionalTensor& attn_mask, int64_t window_left,
                   int64_t window_right, double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                   const OptionalTensor& alibi_slopes) {
  AttentionParams& p = prep.p;
  prep.alibi = fill_options(p, p.q_len + p.kv_len, window_left, window_right, dropout_p, dropout_seed, softcap,
                            alibi_slopes);
  p.window_offset = p.kv_len - p.q_len;
  if (!is_given(attn_mask)) return;
  prep.mask4 = mask_as_4d(*attn_mask, q, p.kv_len);
  p.mask = prep.mask4.data_ptr();
  const at::ScalarType mt = attn_mask->scalar_type();
  p.mask_kind = mt == at::kBool ? MaskKind::boolean : MaskKind::additive;
  p.mask_dtype = mt == at::kBFloat16 ? DType::bf16 : mt == at::kHalf ? DType::f16 : DType::f32;
  int64_t distinct[3];  // the mask's rows: 1 along the dims it is broadcast over
  for (int i = 0; i < 4; ++i) p.mask_strides[i] = prep.mask4.size(i) == 1 ? 0 : prep.mask4.stride(i);
  for (int i = 0; i < 3; ++i) distinct[i] = p.mask_strides[i] == 0 ? 1 : prep.mask4.size(i);
  prep.key_bounds = at::empty({distinct[0], distinct[1], distinct[2], 3}, q.options().dtype(at::kLong));
  check_launch(mask_key_bounds(p, distinct[0], distinct[1], distinct[2], prep.key_bounds.data_ptr<int64_t>(),
                               c10::cuda::getCurrentCUDAStream()),
               "attn_mask's key bounds");
  p.key_ranges = prep.key_bounds.data_ptr<int64_t>();
  for (int i = 0; i < 3; ++i) p.key_range_strides[i] = distinct[i] == 1 ? 0 : prep.key_bounds.stride(i);
}

std::tuple<at::Tensor, at::Tensor> run_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const std::string& impl, std::optional<double> scale,
                                               const std::string& causal, std::optional<int64_t> block_q,
                                               std::optional<int64_t> block_k, bool want_lse,
                                               const OptionalTensor& attn_mask = {}, int64_t window_left = -1,
                                               int64_t window_right = -1, double dropout_p = 0.0,
                                               const OptionalTensor& dropout_seed = {}, double softcap = 0.0,
                                               const OptionalTensor& alibi_slopes = {}) {
  const Impl which = parse_impl(impl);
  const DType dtype = check_attention(q, k, v, which, scale, causal, block_q, block_k, attn_mask, window_left,
                                      window_right, dropout_p, dropout_seed, softcap, alibi_slopes);
  const c10::cuda::CUDAGuard guard(q.device());
  Prepared prep = prepare(q, k, v, dtype, scale, causal, block_q, block_k);
  fill_features(prep, q, attn_mask, window_left, window_right, dropout_p, dropout_seed, softcap, alibi_slopes);
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
  if (p.batch * p.num_heads > 0) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    // Hopper's wgmma/TMA kernel where it takes the call (CS149GPT_HOPPER=0: the FlashAttention-2 kernel everywhere).
    const bool hopper = prep.fast && config_flag("CS149GPT_HOPPER", true) && hopper_fwd_supports(p);
    if (hopper)
      check_launch(flash_fwd_hopper(p, stream), "Hopper flash forward");
    else
      check_launch(prep.fast ? flash_fwd(p, stream) : flash_teaching_fwd(p, stream),
                   prep.fast ? "flash forward" : "teaching flash forward");
  }
  const auto lead = q.sizes().slice(0, q.dim() - 1);
  return {out.view(q.sizes()), want_lse ? lse.view(lead) : lse};
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& impl,
                     std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                     std::optional<int64_t> block_k) {
  return std::get<0>(run_forward(q, k, v, impl, scale, causal, block_q, block_k, false));
}

std::tuple<at::Tensor, at::Tensor> flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   std::optional<double> scale, const std::string& causal,
                                                   std::optional<int64_t> block_q, std::optional<int64_t> block_k,
                                                   const std::optional<at::Tensor>& attn_mask, int64_t window_left,
                                                   int64_t window_right, double dropout_p,
                                                   const std::optional<at::Tensor>& dropout_seed, double softcap,
                                                   const std::optional<at::Tensor>& alibi_slopes) {
  return run_forward(q, k, v, "flash", scale, causal, block_q, block_k, true, attn_mask, window_left, window_right,
                     dropout_p, dropout_seed, softcap, alibi_slopes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
    std::optional<int64_t> block_k, const std::optional<at::Tensor>& attn_mask, int64_t window_left,
    int64_t window_right, double dropout_p, const std::optional<at::Tensor>& dropout_seed, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {
  const DType dtype = check_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k, attn_mask,
                                               window_left, window_right, dropout_p, dropout_seed, softcap,
                                               alibi_slopes);
  const c10::cuda::CUDAGuard guard(q.device());
  Prepared prep = prepare(q, k, v, dtype, scale, causal, block_q, block_k);
  fill_features(prep, q, attn_mask, window_left, window_right, dropout_p, dropout_seed, softcap, alibi_slopes);

  AttentionBackwardParams bp;
  bp.fwd = prep.p;
  const at::Tensor dout4 = as_4d_aligned(dout, true), out4 = as_4d_aligned(out, true);
  const at::Tensor lse3 = lse.reshape({bp.fwd.batch, bp.fwd.num_heads, bp.fwd.q_len}).contiguous();
  bp.fwd.out = out4.data_ptr();
  fill_strides(bp.fwd.out_strides, out4);
  bp.fwd.lse = const_cast<float*>(lse3.data_ptr<float>());
  bp.fwd.lse_strides[0] = lse3.stride(0);
  bp.fwd.lse_strides[1] = lse3.stride(1);
  bp.dout = dout4.data_ptr();
  fill_strides(bp.dout_strides, dout4);
  // GQA: one block per query head and key block, each writing its head's share of dK, dV; the group's shares are
  // summed here (as FlashAttention-2 does): as many blocks as plain attention, so a causal grid balances.
  // CS149GPT_BWD_GQA_SPLIT=0 (benchmarks) keeps one block per kv head, summing the group inside the block.
  const int64_t group = bp.fwd.num_heads / bp.fwd.num_kv_heads;
  const bool per_query_head = group > 1 && config_flag("CS149GPT_BWD_GQA_SPLIT", true);
  at::Tensor dk = at::empty(prep.k4.sizes(), k.options()), dv = at::empty(prep.v4.sizes(), v.options());
  at::Tensor dk_heads = dk, dv_heads = dv;  // what the kernel writes
  if (per_query_head) {
    dk_heads = at::empty({bp.fwd.batch, bp.fwd.num_heads, bp.fwd.kv_len, bp.fwd.head_dim}, k.options());
    dv_heads = at::empty_like(dk_heads);
  }
  bp.dk = dk_heads.data_ptr();
  bp.dv = dv_heads.data_ptr();
  fill_strides(bp.dk_strides, dk_heads);
  fill_strides(bp.dv_strides, dv_heads);
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq_accum = at::zeros({bp.fwd.batch, bp.fwd.num_heads, bp.fwd.q_len, bp.fwd.head_dim}, f32);
  at::Tensor delta = at::empty({bwd_row_stats_floats(bp.fwd)}, f32);
  if (bp.fwd.batch * bp.fwd.num_heads > 0) {
    // Hopper's wgmma/TMA backward where it takes the call, same contract (CS149GPT_HOPPER=0: FA2's everywhere).
    const bool hopper = config_flag("CS149GPT_HOPPER", true) && hopper_bwd_supports(bp);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    if (hopper)
      check_launch(flash_bwd_hopper(bp, delta.data_ptr<float>(), dq_accum.data_ptr<float>(), per_query_head, stream),
                   "Hopper flash backward");
    else
      check_launch(flash_bwd(bp, delta.data_ptr<float>(), dq_accum.data_ptr<float>(), per_query_head, stream),
                   "flash backward");
  }
  if (per_query_head) {  // (batch, kv heads, group, kv_len, d) summed over the group
    const auto grouped = [&](const at::Tensor& t) {
      return t.view({bp.fwd.batch, bp.fwd.num_kv_heads, group, bp.fwd.kv_len, bp.fwd.head_dim});
    };
    at::sum_out(dk, grouped(dk_heads), {2});
    at::sum_out(dv, grouped(dv_heads), {2});
  }
  at::Tensor dq = dq_accum.mul_(bp.fwd.scale).to(q.scalar_type());
  return {dq.view(q.sizes()), dk.view(k.sizes()), dv.view(v.sizes())};
}

}  // namespace cuda
}  // namespace cs149gpt

// The schemas are declared once, in csrc/module.cpp; this is the CUDA implementation of the same operators.
TORCH_LIBRARY_IMPL(cs149gpt, CUDA, m) {
  m.impl("attention", &cs149gpt::cuda::attention);
  m.impl("flash_attention", &cs149gpt::cuda::flash_attention);
  m.impl("flash_attention_backward", &cs149gpt::cuda::flash_attention_backward);
}
