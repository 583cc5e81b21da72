// The CUDA face of the operators: checks, shape decisions, launches. The only CUDA file that touches a Tensor.
//
// The operators of csrc/module.cpp (schemas declared there, once) that run on the GPU, registered for the CUDA
// dispatch key, so autograd, fake tensors and torch.compile (cs149gpt/ops.py) work unchanged:
//   attention / flash_attention     impl="flash" only (the other rungs are CPU teaching kernels):
//       bfloat16, float16 -> FlashAttention-2 on tensor cores (flash_fwd.cuh), head_dim 64 or 128, sm_80+;
//       float32           -> the teaching kernel, one thread per query row (flash_teaching.cu), any head_dim
//                            whose tiles fit in shared memory; block_q x block_k is its Br x Bc.
//   flash_attention_backward        bfloat16, float16 (flash_bwd.cuh).
//   varlen_attention / _backward    packed sequences (cu_seqlens) through the same kernels, one launch for all.
// The argument checks are the CPU ops' own (checks.h: the same function, so the same words); this file adds only
// the GPU's limits.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
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

// The attributes read here (compute capability, SM count, shared memory per block) are fixed for a device: each is
// asked of the driver once per device and then read from this table (a decoding step at batch 1 is bound by host work).
int device_attribute(cudaDeviceAttr attr, int device) {
  constexpr int kDevices = 64, kAttributes = 128;
  static std::atomic<int> known[kDevices][kAttributes];  // value + 1, or 0 before the first query
  const bool cached = device >= 0 && device < kDevices && attr >= 0 && attr < kAttributes;
  if (cached) {
    const int value_plus_one = known[device][attr].load(std::memory_order_relaxed);
    if (value_plus_one > 0) return value_plus_one - 1;
  }
  int value = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&value, attr, device);
  TORCH_CHECK(err == cudaSuccess, "cs149gpt: cudaDeviceGetAttribute failed: ", cudaGetErrorString(err));
  if (cached && value >= 0) known[device][attr].store(value + 1, std::memory_order_relaxed);
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

// The forward of p on the current stream: Hopper's wgmma/TMA kernel where it takes the call (CS149GPT_HOPPER=0: the
// FlashAttention-2 kernel everywhere), else FlashAttention-2's (fast: bf16/fp16) or the float32 teaching kernel.
// what: a word errors name the call with ("", "varlen ").
void launch_forward(const AttentionParams& p, bool fast, const at::TensorOptions& options, const std::string& what) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (fast && config_flag("CS149GPT_HOPPER", true) && hopper_fwd_supports(p)) {
    at::Tensor tile_counter;  // (the dynamic schedule's workspace)
    if (hopper_fwd_takes_tile_counter(p)) tile_counter = at::zeros({1}, options.dtype(at::kInt));
    check_launch(flash_fwd_hopper(p, stream, tile_counter.defined() ? tile_counter.data_ptr<int>() : nullptr),
                 (what + "Hopper flash forward").c_str());
  } else {
    check_launch(fast ? flash_fwd(p, stream) : flash_teaching_fwd(p, stream),
                 (what + (fast ? "flash forward" : "teaching flash forward")).c_str());
  }
}

// The backward of bp on the current stream: Hopper's kernel where it takes the call (CS149GPT_HOPPER=0: the
// FlashAttention-2 kernel everywhere), else FlashAttention-2's. what: a word errors name the call with ("", "varlen ").
// Under torch.use_deterministic_algorithms(True) both add dQ's blocks in key order (AttentionBackwardParams::
// dq_tickets).
void launch_backward(AttentionBackwardParams bp, float* stats, float* dq_accum, bool per_query_head,
                     const std::string& what, const at::Device& device) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor tickets;
  if (at::globalContext().deterministicAlgorithms()) {
    const bool packed = bp.fwd.cu_seqlens_q != nullptr;
    // (+ 64: at d 64 Hopper's second warpgroup counts on its own first row, 64 below the tile's, which in a short last
    // tile lies past the rows)
    bp.dq_ticket_rows = (packed ? bp.fwd.total_q : bp.fwd.q_len) + 64;
    tickets = at::zeros({checked_product({packed ? 1 : bp.fwd.batch, bp.fwd.num_heads, bp.dq_ticket_rows, 2})},
                        at::TensorOptions().dtype(at::kInt).device(device));
    bp.dq_tickets = tickets.data_ptr<int>();
  }
  if (config_flag("CS149GPT_HOPPER", true) && hopper_bwd_supports(bp))
    check_launch(flash_bwd_hopper(bp, stats, dq_accum, per_query_head, stream),
                 (what + "Hopper flash backward").c_str());
  else
    check_launch(flash_bwd(bp, stats, dq_accum, per_query_head, stream), (what + "flash backward").c_str());
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
  if (p.batch * p.num_heads > 0) launch_forward(p, prep.fast, q.options(), "");
  const auto lead = q.sizes().slice(0, q.dim() - 1);
  return {out.view(q.sizes()), want_lse ? lse.view(lead) : lse};
}

// A varlen call's tensors and params, checked (check_varlen has passed; it returned dtype): q (total_q, Hq, d), k and v
// (total_k, Hkv, d) seen as (1, heads, total, d), sequence b at rows [cu_seqlens[b], cu_seqlens[b + 1]) (attention.h);
// batch counts the sequences and q_len, kv_len are the longest's. cu_seqlens are read on the host once (one small
// device-to-host copy) to check them as the CPU does (varlen_lengths: the same errors) and to size the grid; the
// kernels read them in device memory, each block its own sequence's (sequence_view). With block_table (forward only),
// k and v are a paged cache (num_blocks, page_block_size, Hkv, d) seen as (num_blocks, Hkv, page_block_size, d), pages
// k_strides[0] apart (attention.h): cu_seqlens_k gives the lengths only; the table is checked on the host too (one
// more copy) and read on the device by the forwards (Hopper's: a key tile's page, hopper_takes_shapes; FlashAttention-2's:
// each row's, copy_paged_kv_tiles_async).
struct VarlenPrepared {
  at::Tensor q4, k4, v4, cu_q, cu_k, table;
  AttentionParams p;
  bool fast;    // tensor cores (bf16/f16) rather than the teaching kernel (f32)
  bool covers;  // the sequences cover every row of q and k (else the rows outside them get zeros)
};
at::Tensor packed_as_4d(const at::Tensor& t, bool aligned_rows) {  // (total, heads, d) -> (1, heads, total, d)
  return as_4d_aligned(t.transpose(0, 1).unsqueeze(0), aligned_rows);
}
void point_at_packed(void*& ptr, int64_t (&strides)[3], const at::Tensor& t4) {  // (1, heads, total, d): [0, head, row]
  ptr = t4.data_ptr();
  fill_strides(strides, t4);
  strides[0] = 0;
}
VarlenPrepared prepare_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                              int64_t max_seqlen_k, DType dtype, std::optional<double> scale, bool causal,
                              const std::optional<at::Tensor>& block_table = {}) {
  const bool fast = dtype != DType::f32;
  if (fast) {
    const int major = device_attribute(cudaDevAttrComputeCapabilityMajor, q.device().index());
    TORCH_CHECK(major >= 8, "CUDA flash attention in ", c10::toString(q.scalar_type()),
                " needs a GPU of compute capability 8.0 or newer (tensor-core mma.sync, cp.async); this one is ", major,
                ".x");
  }
  const bool paged = block_table.has_value() && block_table->defined();
  const auto kv_as_4d = [&](const at::Tensor& t) {
    return paged ? as_4d_aligned(t.transpose(1, 2), fast) : packed_as_4d(t, fast);
  };
  VarlenPrepared c{packed_as_4d(q, fast), kv_as_4d(k), kv_as_4d(v), cu_seqlens_q.contiguous(),
                   cu_seqlens_k.contiguous(), paged ? block_table->contiguous() : at::Tensor(), {}, fast, true};
  const int64_t n = c.cu_q.size(0);
  const at::Tensor host = at::cat({c.cu_q, c.cu_k}).cpu();
  const at::Tensor host_k = host.narrow(0, n, n);
  // A paged cache's keys are not rows of k: its sequences' lengths bound nothing but themselves.
  const int64_t total_k = paged ? host_k.data_ptr<int32_t>()[n - 1] : k.size(0);
  const auto [longest_q, longest_k] = varlen_lengths(host.narrow(0, 0, n), host_k, q.size(0), total_k, max_seqlen_q,
                                                     max_seqlen_k, &c.covers);
  if (paged) check_varlen_pages(c.table.cpu(), host_k, k.size(1), k.size(0));
  AttentionParams& p = c.p;
  fill_params(p, c.q4, c.k4, c.v4, dtype, scale, "none");
  p.batch = n - 1;
  p.q_len = longest_q;
  p.kv_len = longest_k;
  p.cu_seqlens_q = c.cu_q.data_ptr<int32_t>();
  p.cu_seqlens_k = c.cu_k.data_ptr<int32_t>();
  p.total_q = q.size(0);
  p.total_k = total_k;
  if (paged) {
    p.block_table = c.table.data_ptr<int32_t>();
    p.block_table_stride = c.table.size(1);
    p.page_size = k.size(1);
    p.num_pages = k.size(0);
  }
  p.is_causal = causal;  // bottom-right in each sequence (sequence_view sets the offsets)
  // Grids: (query or key blocks, heads, sequences), or one dimension of all three under the causal mask.
  TORCH_CHECK_VALUE(p.batch <= 65535 && p.num_heads <= 65535, "CUDA varlen attention takes at most 65535 sequences "
                    "and 65535 heads, got ", p.batch, " and ", p.num_heads);
  TORCH_CHECK_VALUE(p.batch * p.num_heads * ((std::max(p.q_len, p.kv_len) + 15) / 16) < (int64_t{1} << 31),
                    "CUDA varlen attention: sequences x heads x tiles of the longest sequence exceed a grid's 2^31 "
                    "blocks; split the batch");
  if (!fast) {  // the teaching kernel, as prepare() sets it up
    TORCH_CHECK_VALUE(p.batch * p.num_heads <= 65535, "the CUDA float32 teaching kernel takes at most 65535 "
                      "(sequences x heads), got ", p.batch * p.num_heads);
    p.block_q = std::max<int64_t>(1, std::min<int64_t>(kTeachingBlockQ, std::min<int64_t>(p.q_len, 1024)));
    p.block_k = std::max<int64_t>(1, std::min<int64_t>(kTeachingBlockK, p.kv_len));
    const size_t smem_limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, q.device().index());
    while (teaching_smem_bytes(p) > smem_limit && p.block_k > 1) p.block_k /= 2;
    TORCH_CHECK_VALUE(teaching_smem_bytes(p) <= smem_limit, "the float32 teaching kernel's tiles (block_q ",
                      p.block_q, " x block_k ", p.block_k, ", d = ", p.head_dim, ") need ", teaching_smem_bytes(p),
                      " bytes of shared memory, more than this GPU's ", smem_limit);
  }
  return c;
}

// (total, heads, d) rows, zeros where the sequences leave rows out.
at::Tensor packed_output(at::IntArrayRef sizes, bool covers, const at::TensorOptions& options) {
  return covers ? at::empty(sizes, options) : at::zeros(sizes, options);
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
  if (bp.fwd.batch * bp.fwd.num_heads > 0)
    launch_backward(bp, delta.data_ptr<float>(), dq_accum.data_ptr<float>(), per_query_head, "", q.device());
  if (per_query_head) {  // (batch, kv heads, group, kv_len, d) summed over the group
    const auto grouped = [&](const at::Tensor& t) {
      return t.view({bp.fwd.batch, bp.fwd.num_kv_heads, group, bp.fwd.kv_len, bp.fwd.head_dim});
    };
    at::sum_out(dk, grouped(dk_heads), {2});
    at::sum_out(dv, grouped(dv_heads), {2});
  }
  at::Tensor dq = at::empty(dq_accum.sizes(), q.options());
  check_launch(dq_convert(dq_accum.data_ptr<float>(), dq.data_ptr(), dq.numel(), bp.fwd.scale, bp.fwd.dtype,
                          c10::cuda::getCurrentCUDAStream()),
               "dQ conversion");
  return {dq.view(q.sizes()), dk.view(k.sizes()), dv.view(v.sizes())};
}

// varlen_attention on CUDA: one launch over every sequence (flash_fwd.cuh: a block per (query tile of the longest
// sequence, head, sequence), exiting at once past its sequence's end; on Hopper without attn_mask, window or logit
// options, hopper/flash_fwd_hopper.cuh's persistent grid over the same tiles). out (total_q, Hq, d), lse (Hq, total_q).
std::tuple<at::Tensor, at::Tensor> varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                    int64_t max_seqlen_q, int64_t max_seqlen_k,
                                                    std::optional<double> scale, bool causal, int64_t window_left,
                                                    int64_t window_right, double dropout_p,
                                                    const std::optional<at::Tensor>& dropout_seed, double softcap,
                                                    const std::optional<at::Tensor>& alibi_slopes,
                                                    const std::optional<at::Tensor>& block_table) {
  const DType dtype = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                                   window_left, window_right, dropout_p, dropout_seed, softcap, alibi_slopes,
                                   block_table);
  const c10::cuda::CUDAGuard guard(q.device());
  VarlenPrepared c = prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtype, scale,
                                    causal, block_table);
  AttentionParams& p = c.p;
  const at::Tensor alibi = fill_options(p, p.q_len + p.kv_len, window_left, window_right, dropout_p, dropout_seed,
                                        softcap, alibi_slopes);
  const at::Tensor out = packed_output(q.sizes(), c.covers, q.options());
  point_at_packed(p.out, p.out_strides, out.transpose(0, 1).unsqueeze(0));
  const at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  if (!c.covers) lse.fill_(-std::numeric_limits<float>::infinity());
  p.lse = lse.data_ptr<float>();
  p.lse_strides[0] = 0;
  p.lse_strides[1] = lse.stride(0);
  // (a sequence without keys: out 0, lse −inf, which the kernels write)
  if (p.q_len > 0 && p.num_heads > 0) launch_forward(p, c.fast, q.options(), "varlen ");
  return {out, lse};
}

// varlen_attention_backward on CUDA: one launch over every sequence (a block per (key tile of the longest sequence,
// head, sequence)): on Hopper without attn_mask, window, dropout or logit options hopper/flash_bwd_hopper.cuh's, else
// flash_bwd.cuh's; dQ accumulates in float32 rows (heads, total_q, d), dK and dV are written in the packed layout.
// GQA as flash_attention_backward: one share per query head, the group's summed here.
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {
  const DType dtype = check_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, scale, causal, window_left, window_right, dropout_p,
                                            dropout_seed, softcap, alibi_slopes);
  const c10::cuda::CUDAGuard guard(q.device());
  VarlenPrepared c = prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtype, scale,
                                    causal);
  AttentionBackwardParams bp;
  bp.fwd = c.p;
  const at::Tensor alibi = fill_options(bp.fwd, bp.fwd.q_len + bp.fwd.kv_len, window_left, window_right, dropout_p,
                                        dropout_seed, softcap, alibi_slopes);
  const int64_t total_q = q.size(0), total_k = k.size(0), heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  const at::Tensor out4 = packed_as_4d(out, true), dout4 = packed_as_4d(dout, true);
  point_at_packed(bp.fwd.out, bp.fwd.out_strides, out4);
  void* dout_ptr = nullptr;
  point_at_packed(dout_ptr, bp.dout_strides, dout4);
  bp.dout = dout_ptr;
  // lse with rows total_q apart: dq_accum's rows are laid out alike (flash_bwd.cuh, dq_accum_offset).
  const at::Tensor lse_rows = lse.stride(1) == 1 && lse.stride(0) == total_q
                                  ? lse
                                  : at::empty(lse.sizes(), lse.options()).copy_(lse);
  bp.fwd.lse = const_cast<float*>(lse_rows.data_ptr<float>());
  bp.fwd.lse_strides[0] = 0;
  bp.fwd.lse_strides[1] = total_q;
  const int64_t group = heads / kv_heads;
  const bool per_query_head = group > 1 && config_flag("CS149GPT_BWD_GQA_SPLIT", true);
  at::Tensor dk = packed_output(k.sizes(), c.covers, k.options()), dv = packed_output(v.sizes(), c.covers, v.options());
  at::Tensor dk_heads = dk, dv_heads = dv;  // what the kernel writes: (total_k, Hkv or Hq, d)
  if (per_query_head) {
    dk_heads = packed_output({total_k, heads, d}, c.covers, k.options());
    dv_heads = packed_output({total_k, heads, d}, c.covers, v.options());
  }
  void* dk_ptr = nullptr;
  void* dv_ptr = nullptr;
  point_at_packed(dk_ptr, bp.dk_strides, dk_heads.transpose(0, 1).unsqueeze(0));
  point_at_packed(dv_ptr, bp.dv_strides, dv_heads.transpose(0, 1).unsqueeze(0));
  bp.dk = dk_ptr;
  bp.dv = dv_ptr;
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq_accum = at::zeros({heads, total_q, d}, f32);
  const bool launch = bp.fwd.q_len > 0 && bp.fwd.kv_len > 0 && heads > 0;
  if (launch) {
    at::Tensor stats = at::empty({bwd_row_stats_floats(bp.fwd)}, f32);
    launch_backward(bp, stats.data_ptr<float>(), dq_accum.data_ptr<float>(), per_query_head, "varlen ", q.device());
    if (per_query_head) {  // (total_k, kv heads, group, d) summed over the group
      at::sum_out(dk, dk_heads.view({total_k, kv_heads, group, d}), {2});
      at::sum_out(dv, dv_heads.view({total_k, kv_heads, group, d}), {2});
    }
  } else {  // no query sees a key: zero gradients
    dk.zero_();
    dv.zero_();
  }
  const at::Tensor dq = at::empty(q.sizes(), q.options());
  if (launch) dq.copy_(dq_accum.mul_(bp.fwd.scale).transpose(0, 1));
  else dq.zero_();
  return {dq, dk, dv};
}

}  // namespace cuda
}  // namespace cs149gpt

// The schemas are declared once, in csrc/module.cpp; this is the CUDA implementation of the same operators.
TORCH_LIBRARY_IMPL(cs149gpt, CUDA, m) {
  m.impl("attention", &cs149gpt::cuda::attention);
  m.impl("flash_attention", &cs149gpt::cuda::flash_attention);
  m.impl("flash_attention_backward", &cs149gpt::cuda::flash_attention_backward);
  m.impl("varlen_attention", &cs149gpt::cuda::varlen_attention);
  m.impl("varlen_attention_backward", &cs149gpt::cuda::varlen_attention_backward);
}

// ---------------------------------------------------------------------------------------------------
// attention_with_kvcache on CUDA (flash_decode.cu): the CPU op's contract (module.cpp), the same shared checks
// (check_kvcache). The per-sequence data (cache_seqlens, cache_leftpad, cache_batch_idx, block_table) stays on the GPU,
// read by the kernels alone: no copy to the host and no synchronisation in a decoding step. So the checks of their
// values that the CPU op makes before reading (a length past the capacity, a block id or cache row outside the cache,
// two sequences appending into one row) are not made here; the kernels clamp every such index into the cache instead,
// so a bad entry gives a wrong answer, never an access outside the cache.
// ---------------------------------------------------------------------------------------------------
#include <ATen/MemoryOverlap.h>

namespace cs149gpt {
namespace cuda {
namespace {

// A tensor whose rows the decode kernels read with 16-byte loads: base and strides multiples of 16 bytes.
bool rows_aligned_16(const at::Tensor& t) {
  const int64_t vec = 16 / static_cast<int64_t>(t.element_size());
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.size(-1) <= 1 || t.stride(-1) == 1);
  for (int64_t i = 0; i + 1 < t.dim(); ++i) ok = ok && (t.size(i) == 1 || t.stride(i) % vec == 0);
  return ok;
}

// q, k_new, v_new: a view where aligned, else a contiguous copy (they are read, never written).
at::Tensor aligned_input(const at::Tensor& t) { return rows_aligned_16(t) ? t : t.contiguous(); }

}  // namespace

at::Tensor attention_with_kvcache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                                  const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
                                  std::optional<double> scale, bool is_causal, const OptionalTensor& cache_batch_idx,
                                  const OptionalTensor& cache_leftpad, int64_t window_left, int64_t window_right,
                                  double softcap, const OptionalTensor& alibi_slopes, const OptionalTensor& lse) {
  const DType dtype = check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale,
                                    cache_batch_idx, cache_leftpad, window_left, window_right, softcap, alibi_slopes,
                                    lse);
  const c10::cuda::CUDAGuard guard(q.device());
  const int device = q.device().index();
  const int major = device_attribute(cudaDevAttrComputeCapabilityMajor, device);
  TORCH_CHECK(major >= 8, "attention_with_kvcache on CUDA needs a GPU of compute capability 8.0 or newer; this one is ",
              major, ".x");
  const bool paged = block_table.has_value() && block_table->defined();
  const bool append = k_new.has_value() && k_new->defined();
  if (append) {  // as the CPU op: one memory for both caches would take v_new over k_new
    const at::MemOverlapStatus overlap = at::get_overlap_status(k_cache, v_cache);
    TORCH_CHECK_VALUE(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
                      "k_cache and v_cache share memory, so k_new and v_new would be written over each other; pass "
                      "two caches");
  }
  for (const auto& [name, t] : {std::pair{"k_cache", &k_cache}, std::pair{"v_cache", &v_cache}})
    TORCH_CHECK_VALUE(rows_aligned_16(*t), "attention_with_kvcache on CUDA reads ", name, " in 16-byte loads: its data "
                      "pointer and strides must be multiples of 16 bytes, got strides ", t->strides(),
                      " (the cache is written in place, so no aligned copy can stand in for it)");
  const int64_t B = q.size(0), Nq = q.size(2), d = q.size(3);
  const int64_t page_size = k_cache.size(2);
  const int64_t capacity = paged ? checked_product({block_table->size(1), page_size}) : k_cache.size(2);
  const int64_t added = append ? k_new->size(2) : 0;
  // (2^30: the decode kernels count keys in int, with room for a split's and a tile's step past the end)
  constexpr int64_t kMaxCacheKeys = int64_t{1} << 30;
  TORCH_CHECK_VALUE(capacity >= 0 && capacity <= kMaxCacheKeys, "attention_with_kvcache on CUDA takes caches of at "
                    "most ", kMaxCacheKeys, " keys per sequence, got ", capacity);
  TORCH_CHECK_VALUE(added <= capacity, "k_new has ", added, " new keys, more than the cache's capacity of ", capacity,
                    " keys");

  const at::Tensor q4 = aligned_input(q);
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const at::Tensor table = paged ? block_table->contiguous() : at::Tensor();
  const at::Tensor batch_idx = is_given(cache_batch_idx) ? cache_batch_idx->contiguous() : at::Tensor();
  const at::Tensor leftpad = is_given(cache_leftpad) ? cache_leftpad->contiguous() : at::Tensor();
  at::Tensor k_new4, v_new4;
  DecodeParams dp;
  AttentionParams& p = dp.p;
  fill_params(p, q4, k_cache, v_cache, dtype, scale, "none");
  p.kv_len = capacity;  // an upper bound: each sequence's own length is read on the device
  p.is_causal = is_causal;
  p.window_left = window_bound(window_left, p.q_len + capacity);
  p.window_right = window_bound(window_right, p.q_len + capacity);
  p.softcap = static_cast<float>(softcap);
  at::Tensor slopes;
  if (is_given(alibi_slopes)) {
    slopes = *alibi_slopes;
    p.alibi_slopes = slopes.data_ptr<float>();
    p.alibi_strides[0] = slopes.dim() == 2 ? slopes.stride(0) : 0;
    p.alibi_strides[1] = slopes.stride(slopes.dim() - 1);
  }
  p.cache_seqlens = seqlens.data_ptr();
  p.cache_seqlens_int64 = seqlens.scalar_type() == at::kLong;
  if (leftpad.defined()) p.cache_leftpad = leftpad.data_ptr<int32_t>();
  if (batch_idx.defined()) p.cache_batch_idx = batch_idx.data_ptr<int32_t>();
  if (paged) {
    p.block_table = table.data_ptr<int32_t>();
    p.block_table_stride = table.size(1);
    p.page_size = page_size;
    p.num_pages = k_cache.size(0);
  }
  if (append) {
    k_new4 = aligned_input(*k_new);
    v_new4 = aligned_input(*v_new);
    p.k_new = k_new4.data_ptr();
    p.v_new = v_new4.data_ptr();
    p.new_len = added;
    fill_strides(p.k_new_strides, k_new4);
    fill_strides(p.v_new_strides, v_new4);
  }
  at::Tensor out = at::empty({B, p.num_heads, Nq, d}, q.options());
  p.out = out.data_ptr();
  fill_strides(p.out_strides, out);
  if (is_given(lse)) {
    p.lse = lse->data_ptr<float>();
    p.lse_strides[0] = lse->stride(0);
    p.lse_strides[1] = lse->stride(1);
  }
  if (B * p.num_heads == 0) return out;
  TORCH_CHECK_VALUE(k_cache.size(0) > 0, "k_cache has no ", paged ? "blocks" : "rows", " (dim 0 is 0)");
  dp.capacity = capacity;
  if (paged && (page_size & (page_size - 1)) == 0) dp.page_shift = __builtin_ctzll(static_cast<uint64_t>(page_size));
  dp.cache_rows = k_cache.size(0);
  dp.rows_per_block = decode_rows_per_block(p);
  const int64_t rows = p.num_heads / p.num_kv_heads * Nq;
  dp.row_tiles = static_cast<int>((rows + dp.rows_per_block - 1) / dp.rows_per_block);
  dp.splits = decode_splits(p, capacity, dp.rows_per_block, device_attribute(cudaDevAttrMultiProcessorCount, device));
  dp.smem_per_block = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  dp.device = device;
  at::Tensor parts;
  if (dp.splits > 1) {  // the splits' partials: O_s (d floats), then m_s, l_s, per (batch, kv head, split, row)
    const int64_t count = B * p.num_kv_heads * dp.splits * rows;
    parts = at::empty({count * (d + 2)}, q.options().dtype(at::kFloat));
    dp.part_o = parts.data_ptr<float>();
    dp.part_ml = dp.part_o + count * d;
  }
  check_launch(flash_decode(dp, c10::cuda::getCurrentCUDAStream()), "decode (attention_with_kvcache)");
  return out;
}

// merge_partial_ on CUDA: the CPU op's contract (module.cpp), the same shared checks (check_merge).
void merge_partial_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& out_block,
                    const at::Tensor& lse_block) {
  const DType dtype = check_merge(out, lse, out_block, lse_block);
  if (lse.numel() == 0) return;  // (head_dim 0 still merges lse)
  const c10::cuda::CUDAGuard guard(out.device());
  check_launch(merge_partial(merge_params(out, lse, out_block, lse_block, dtype), c10::cuda::getCurrentCUDAStream()),
               "merge_partial_");
}

}  // namespace cuda
}  // namespace cs149gpt

TORCH_LIBRARY_IMPL(cs149gpt, CUDA, m) {
  m.impl("attention_with_kvcache", &cs149gpt::cuda::attention_with_kvcache);
  m.impl("merge_partial_", &cs149gpt::cuda::merge_partial_);
}
