// The Tensor edge of the CPU kernels and the module's bindings: the operators' schemas, their CPU implementations
// (check the arguments, fill the params, allocate the outputs and the workspace, run the kernel of the ISA chosen at
// load time), the eager fast paths, and the Python bindings. The checks and the params live in checks.cpp, the tile
// and path choices in heuristics.h; kernels never see a Tensor.
#include <torch/extension.h>
#include <torch/library.h>
#include <pybind11/stl.h>

#include <sched.h>
#include <unistd.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attention.h"
#include "checks.h"
#include "heuristics.h"
#include "testing.h"
#include "workspace.h"

namespace cs149gpt {
namespace {

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

const Kernel kTeachingKernel = {flash_teaching_workspace_floats, flash_teaching_attention};

// Runs one forward kernel. Returns (out, lse); lse is defined only when asked for (flash only).
std::tuple<at::Tensor, at::Tensor> run_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 Impl impl, std::optional<double> scale, const std::string& causal,
                                                 std::optional<int64_t> block_q, std::optional<int64_t> block_k,
                                                 bool want_lse, const OptionalTensor& attn_mask = {},
                                                 int64_t window_left = -1, int64_t window_right = -1,
                                                 double dropout_p = 0.0, const OptionalTensor& dropout_seed = {},
                                                 double softcap = 0.0, const OptionalTensor& alibi_slopes = {}) {
  TORCH_CHECK_VALUE(!want_lse || impl == Impl::flash, "lse is computed by impl='flash' only");
  const DType dtype = check_attention(q, k, v, impl, scale, causal, block_q, block_k, attn_mask, window_left,
                                      window_right, dropout_p, dropout_seed, softcap, alibi_slopes);
  Prepared prep = prepare(q, k, v, impl, dtype, scale, causal, block_q, block_k, attn_mask, window_left, window_right,
                          dropout_p, dropout_seed, softcap, alibi_slopes);
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
    // A few query rows (decoding) go to flash-decoding, which splits the keys instead (attention.h), attn_mask,
    // window, softcap and ALiBi included; the tiled kernels take the rest.
    case Impl::flash:
      kernel = heuristics::decode_kernel_takes(p) ? &kernels.decode : &kernels.flash;
      break;
    case Impl::flash_teaching: kernel = &kTeachingKernel; break;
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
//   softcap > 0: each scaled logit s becomes softcap · tanh(s / softcap) before attn_mask; alibi_slopes (Hq,) or
//   (B, Hq) float32: −slope · |i + Nk − Nq − j| added to it (attention.h).
std::tuple<at::Tensor, at::Tensor> flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   std::optional<double> scale, const std::string& causal,
                                                   std::optional<int64_t> block_q, std::optional<int64_t> block_k,
                                                   const OptionalTensor& attn_mask, int64_t window_left,
                                                   int64_t window_right, double dropout_p,
                                                   const OptionalTensor& dropout_seed, double softcap,
                                                   const OptionalTensor& alibi_slopes) {
  return run_attention(q, k, v, Impl::flash, scale, causal, block_q, block_k, true, attn_mask, window_left,
                       window_right, dropout_p, dropout_seed, softcap, alibi_slopes);
}

namespace {
int64_t machine_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN));
}
}  // namespace

// flash_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k) -> (dq, dk, dv)
//   The gradients of flash_attention's out with respect to q, k, v, given dout = ∂L/∂out and the forward's
//   out and lse; P is recomputed tile by tile from lse (flash_backward.cpp). dk, dv have k's and v's shape.
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
    std::optional<int64_t> block_k, const OptionalTensor& attn_mask, int64_t window_left, int64_t window_right,
    double dropout_p, const OptionalTensor& dropout_seed, double softcap, const OptionalTensor& alibi_slopes) {
  const DType dtype = check_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k, attn_mask,
                                               window_left, window_right, dropout_p, dropout_seed, softcap,
                                               alibi_slopes);
  Prepared prep = prepare(q, k, v, Impl::flash, dtype, scale, causal, block_q, block_k, attn_mask, window_left,
                          window_right, dropout_p, dropout_seed, softcap, alibi_slopes);

  AttentionBackwardParams bp;
  bp.fwd = prep.p;
  heuristics::choose_backward(bp, machine_cpus(), kernels().bf16_dot_probe != nullptr, testing::backward_force);
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
// A packed tensor whose head_dim is strided gets a copy (SIMD loads need the columns adjacent); any other is read in place.
at::Tensor rows_readable(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// A varlen call's tensors and params, checked (check_varlen has passed; it returned dtype) and filled: sequence b is rows
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q, [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v (attention.h).
// With block_table, k and v are a paged cache (num_blocks, page_block_size, Hkv, d): sequence b's keys are 0 ..
// cu_seqlens_k[b + 1] − cu_seqlens_k[b] − 1, key t at row t % page_block_size of block block_table[b, t / page_block_size].
struct VarlenCall {
  at::Tensor q, k, v, cu_q, cu_k, alibi, block_table;
  AttentionParams p;
  bool covers = true;  // the sequences cover every row of q and k (else the outputs start as zeros)
};
VarlenCall prepare_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                          const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, DType dtype,
                          std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
                          double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                          const OptionalTensor& alibi_slopes, const OptionalTensor& block_table = {}) {
  TORCH_CHECK_VALUE(q.device().is_cpu(), "q must be on the CPU, got a tensor on ", q.device());
  const bool paged = is_given(block_table);
  VarlenCall c{rows_readable(q), rows_readable(k), rows_readable(v), cu_seqlens_q.contiguous(),
               cu_seqlens_k.contiguous(), {}, paged ? block_table->contiguous() : at::Tensor(), {}, true};
  // A paged cache's keys are not rows of k: cu_seqlens_k gives the lengths only (its last offset bounds nothing).
  const int64_t total_k = paged ? c.cu_k.data_ptr<int32_t>()[c.cu_k.size(0) - 1] : k.size(0);
  const auto [longest_q, longest_k] =
      varlen_lengths(c.cu_q, c.cu_k, q.size(0), total_k, max_seqlen_q, max_seqlen_k, &c.covers);
  AttentionParams& p = c.p;
  // (total, heads, d) as (1, heads, total, d): head and row strides; the sequences then set where each starts. A paged
  // cache as (num_blocks, heads, page_block_size, d): pages k_strides[0] apart (attention.h, kv_row).
  const auto as_4d_kv = [&](const at::Tensor& t) { return paged ? t.transpose(1, 2) : t.transpose(0, 1).unsqueeze(0); };
  fill_params(p, c.q.transpose(0, 1).unsqueeze(0), as_4d_kv(c.k), as_4d_kv(c.v), dtype, scale, "none");
  if (paged) {
    check_varlen_pages(c.block_table, c.cu_k, k.size(1), k.size(0));
    p.block_table = c.block_table.data_ptr<int32_t>();
    p.block_table_stride = c.block_table.stride(0);
    p.page_size = k.size(1);
    p.num_pages = k.size(0);
  }
  p.batch = c.cu_q.size(0) - 1;
  p.q_len = longest_q;
  p.kv_len = longest_k;
  p.cu_seqlens_q = c.cu_q.data_ptr<int32_t>();
  p.cu_seqlens_k = c.cu_k.data_ptr<int32_t>();
  p.is_causal = causal;  // bottom-right in each sequence (sequence_view sets the offsets)
  p.block_q = p.block_k = 0;  // the kernels' tiles (heuristics.h)
  // (Hq,) slopes: stride 0 over the sequences; (batch, Hq): a row each.
  c.alibi = fill_options(p, longest_q + longest_k, window_left, window_right, dropout_p, dropout_seed, softcap,
                         alibi_slopes);
  return c;
}

// out or a gradient, (total, heads, d) dense; zeros where the sequences leave rows out.
at::Tensor varlen_output(const at::Tensor& like, bool covers, const char* name) {
  check_fits(like.numel(), like.element_size(), [&] { return shape_of(name, like.sizes()); });
  return covers ? at::empty(like.sizes(), like.options()) : at::zeros(like.sizes(), like.options());
}
// A kernel call's work and workspace grow with its sequences × its longest one (its tasks and packed tiles are laid
// out per sequence at the longest's size): one 8192-token sequence beside 511 of one token would size them by
// 512 × 8192. So the sequences run in groups of similar lengths, each one kernel call: longest first, a sequence joins
// the group while the group's sequences × (its longest query + key lengths) stays within twice its tokens (plus 8192:
// small batches stay whole). A group's params list its sequences' starts and ends (seq_end_q/k), its slopes and table
// rows; dropout's numbering stays the whole batch's (dropout_key_stride).
struct SequenceGroup {
  at::Tensor starts_q, ends_q, starts_k, ends_k, alibi, block_table;  // undefined: the whole batch, as it is
  int64_t count = 0, longest_q = 0, longest_k = 0;
};
std::vector<SequenceGroup> sequence_groups(const VarlenCall& c) {
  const int64_t batch = c.p.batch;
  const int32_t *cq = c.cu_q.data_ptr<int32_t>(), *ck = c.cu_k.data_ptr<int32_t>();
  std::vector<int64_t> order(batch);
  for (int64_t b = 0; b < batch; ++b) order[b] = b;
  const auto len_q = [&](int64_t b) -> int64_t { return cq[b + 1] - cq[b]; };
  const auto len_k = [&](int64_t b) -> int64_t { return ck[b + 1] - ck[b]; };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return len_q(a) + len_k(a) > len_q(b) + len_k(b); });
  std::vector<std::vector<int64_t>> members;
  int64_t lq = 0, lk = 0, tokens = 0;
  for (int64_t b : order) {
    const int64_t n = members.empty() ? 0 : static_cast<int64_t>(members.back().size());
    const int64_t nq = std::max(lq, len_q(b)), nk = std::max(lk, len_k(b)), nt = tokens + len_q(b) + len_k(b);
    if (members.empty() || (n + 1) * (nq + nk) > 2 * nt + 8192) {
      members.push_back({b});
      lq = len_q(b), lk = len_k(b), tokens = len_q(b) + len_k(b);
    } else {
      members.back().push_back(b);
      lq = nq, lk = nk, tokens = nt;
    }
  }
  std::vector<SequenceGroup> groups;
  if (members.size() <= 1) {
    groups.push_back({{}, {}, {}, {}, {}, {}, batch, c.p.q_len, c.p.kv_len});
    return groups;
  }
  const auto ints = at::TensorOptions().dtype(at::kInt);
  for (const auto& m : members) {
    SequenceGroup g;
    g.count = static_cast<int64_t>(m.size());
    g.starts_q = at::empty({g.count}, ints), g.ends_q = at::empty({g.count}, ints);
    g.starts_k = at::empty({g.count}, ints), g.ends_k = at::empty({g.count}, ints);
    for (int64_t i = 0; i < g.count; ++i) {
      const int64_t b = m[i];
      g.starts_q.data_ptr<int32_t>()[i] = cq[b], g.ends_q.data_ptr<int32_t>()[i] = cq[b + 1];
      g.starts_k.data_ptr<int32_t>()[i] = ck[b], g.ends_k.data_ptr<int32_t>()[i] = ck[b + 1];
      g.longest_q = std::max(g.longest_q, len_q(b)), g.longest_k = std::max(g.longest_k, len_k(b));
    }
    const at::Tensor index = at::tensor(std::vector<int64_t>(m.begin(), m.end()), at::TensorOptions().dtype(at::kLong));
    if (c.alibi.defined() && c.alibi.dim() == 2) g.alibi = c.alibi.index_select(0, index).contiguous();
    if (c.block_table.defined()) g.block_table = c.block_table.index_select(0, index).contiguous();
    groups.push_back(std::move(g));
  }
  return groups;
}
// The params of one group's kernel call (sequence_groups).
AttentionParams group_params(const AttentionParams& p, const SequenceGroup& g) {
  AttentionParams s = p;
  s.dropout_key_stride = p.kv_len;
  if (!g.starts_q.defined()) return s;
  s.batch = g.count, s.q_len = g.longest_q, s.kv_len = g.longest_k;
  s.cu_seqlens_q = g.starts_q.data_ptr<int32_t>(), s.seq_end_q = g.ends_q.data_ptr<int32_t>();
  s.cu_seqlens_k = g.starts_k.data_ptr<int32_t>(), s.seq_end_k = g.ends_k.data_ptr<int32_t>();
  if (g.alibi.defined()) s.alibi_slopes = g.alibi.data_ptr<float>(), s.alibi_strides[0] = g.alibi.stride(0);
  if (g.block_table.defined()) {
    s.block_table = g.block_table.data_ptr<int32_t>();
    s.block_table_stride = g.block_table.stride(0);
  }
  return s;
}

void point_at(void*& ptr, int64_t (&strides)[3], const at::Tensor& t) {  // (total, heads, d): [0, head, row]
  ptr = t.data_ptr();
  strides[0] = 0;
  strides[1] = t.stride(1);
  strides[2] = t.stride(0);
}
}  // namespace

// varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window_left,
//                  window_right, dropout_p, dropout_seed, softcap, alibi_slopes) -> (out, lse)
//   FlashAttention's packed variable-length attention: q (total_q, Hq, d), k and v (total_k, Hkv, d), sequence b at rows
//   [cu_seqlens[b], cu_seqlens[b + 1]) of each; causal and window bottom-right in each sequence. out (total_q, Hq, d)
//   dense; lse (Hq, total_q) float32, −inf for a row that sees no key. One kernel call over every sequence: its tasks
//   are (sequence, head, query tile). softcap and alibi_slopes ((Hq,) or (batch, Hq)) as flash_attention's, ALiBi's
//   distance i + Nk − Nq − j taken in each sequence.
//   block_table (batch, max_blocks) int32: k and v are a paged KV cache (num_blocks, page_block_size, Hkv, d) instead,
//   sequence b's keys 0 .. cu_seqlens_k[b + 1] − cu_seqlens_k[b] − 1, key t at row t % page_block_size of block
//   block_table[b, t / page_block_size] (FlashAttention's); the kernels read each key through the table. Forward only.
std::tuple<at::Tensor, at::Tensor> varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                    int64_t max_seqlen_q, int64_t max_seqlen_k,
                                                    std::optional<double> scale, bool causal, int64_t window_left,
                                                    int64_t window_right, double dropout_p,
                                                    const OptionalTensor& dropout_seed, double softcap,
                                                    const OptionalTensor& alibi_slopes,
                                                    const OptionalTensor& block_table) {
  const DType dtype = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                                   window_left, window_right, dropout_p, dropout_seed, softcap, alibi_slopes,
                                   block_table);
  VarlenCall c = prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtype, scale, causal,
                                window_left, window_right, dropout_p, dropout_seed, softcap, alibi_slopes, block_table);
  AttentionParams& p = c.p;
  const at::Tensor out = varlen_output(q, c.covers, "out");
  point_at(p.out, p.out_strides, out);
  const at::Tensor lse = checked_empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat), "lse");
  if (!c.covers || p.kv_len == 0) lse.fill_(-std::numeric_limits<float>::infinity());
  p.lse = lse.data_ptr<float>();
  p.lse_strides[0] = 0;
  p.lse_strides[1] = lse.stride(0);
  if (p.q_len > 0 && p.kv_len > 0) {  // else every row sees no key: zeros, lse −inf
    const Kernel& kernel = kernels().flash;
    for (const SequenceGroup& g : sequence_groups(c)) {
      const AttentionParams pg = group_params(p, g);
      if (pg.q_len == 0) continue;
      if (pg.kv_len == 0) {  // (only a group of sequences without keys: their rows see none)
        for (int64_t i = 0; i < pg.batch; ++i) {
          const AttentionParams seq = sequence_view(pg, i);
          out.narrow(0, pg.cu_seqlens_q[i], seq.q_len).zero_();
          lse.narrow(1, pg.cu_seqlens_q[i], seq.q_len).fill_(-std::numeric_limits<float>::infinity());
        }
        continue;
      }
      kernel.run(pg, workspace(kernel, pg, pg, "the workspace of varlen_attention").data_ptr<float>());
    }
  } else {
    out.zero_();
  }
  return {out, lse};
}

// varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ...) -> (dq, dk, dv)
//   The gradients of varlen_attention's out, from its out and lse; dq like q, dk and dv like k and v, (total, heads, d).
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
    double dropout_p, const OptionalTensor& dropout_seed, double softcap, const OptionalTensor& alibi_slopes) {
  const DType dtype = check_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, scale, causal, window_left, window_right, dropout_p,
                                            dropout_seed, softcap, alibi_slopes);
  VarlenCall c = prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtype, scale, causal,
                                window_left, window_right, dropout_p, dropout_seed, softcap, alibi_slopes);
  AttentionBackwardParams bp;
  bp.fwd = c.p;
  heuristics::choose_backward(bp, machine_cpus(), kernels().bf16_dot_probe != nullptr, testing::backward_force);
  const at::Tensor dout_r = rows_readable(dout), out_r = rows_readable(out), lse_c = lse.contiguous();
  point_at(bp.fwd.out, bp.fwd.out_strides, out_r);
  bp.fwd.lse = const_cast<float*>(lse_c.data_ptr<float>());
  bp.fwd.lse_strides[0] = 0;
  bp.fwd.lse_strides[1] = lse_c.stride(0);
  void* dout_ptr = nullptr;
  point_at(dout_ptr, bp.dout_strides, dout_r);
  bp.dout = dout_ptr;
  const at::Tensor dq = varlen_output(q, c.covers, "dq"), dk = varlen_output(k, c.covers, "dk"),
                   dv = varlen_output(v, c.covers, "dv");
  point_at(bp.dq, bp.dq_strides, dq);
  point_at(bp.dk, bp.dk_strides, dk);
  point_at(bp.dv, bp.dv_strides, dv);
  if (bp.fwd.q_len > 0 && bp.fwd.kv_len > 0) {
    const BackwardKernel& kernel = kernels().flash_backward;
    for (const SequenceGroup& g : sequence_groups(c)) {
      AttentionBackwardParams bg = bp;
      bg.fwd = group_params(bp.fwd, g);
      if (bg.fwd.q_len == 0 || bg.fwd.kv_len == 0) {  // no query sees a key: zero gradients
        for (int64_t i = 0; i < bg.fwd.batch; ++i) {
          const AttentionParams seq = sequence_view(bg.fwd, i);
          dq.narrow(0, bg.fwd.cu_seqlens_q[i], seq.q_len).zero_();
          dk.narrow(0, bg.fwd.cu_seqlens_k[i], seq.kv_len).zero_();
          dv.narrow(0, bg.fwd.cu_seqlens_k[i], seq.kv_len).zero_();
        }
        continue;
      }
      heuristics::choose_backward(bg, machine_cpus(), kernels().bf16_dot_probe != nullptr, testing::backward_force);
      kernel.run(bg, workspace(kernel, bg, bg.fwd, "the workspace of the varlen backward").data_ptr<float>());
    }
  } else {
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  return {dq, dk, dv};
}

// merge_partial_(out, lse, out_block, lse_block): (out, lse) ← the attention of both sides' keys together, from each
//   side's normalised output and logsumexp (attention.h, MergeParams; ring attention's step). In place, float32.
void merge_partial_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& out_block,
                    const at::Tensor& lse_block) {
  const DType dtype = check_merge(out, lse, out_block, lse_block);
  if (lse.numel() == 0) return;  // (head_dim 0 still merges lse)
  MergeParams mp = merge_params(out, lse, out_block, lse_block, dtype);
  mp.num_threads = at::get_num_threads();
  kernels().merge_partial(mp);
}

// attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale, is_causal,
//                        cache_batch_idx, cache_leftpad, window_left, window_right, softcap, alibi_slopes, lse) -> out
//   Sequence b's keys are rows [cache_leftpad[b], cache_seqlens[b]) of its cache (row cache_batch_idx[b] of a contiguous
//   one, the blocks of block_table's row b of a paged one); k_new, v_new (B, Hkv, N_new, d), when given, are written at
//   rows [cache_seqlens[b], cache_seqlens[b] + N_new) first, and then seen too: L_b keys in all. Causal and the window
//   are bottom-right aligned to L_b (query i of Nq sees keys j <= L_b − Nq + i, counted from cache_leftpad[b]).
//   out: (B, Hq, Nq, d), contiguous, q's dtype; lse, when given, (B, Hq, Nq) float32, written in place.
at::Tensor attention_with_kvcache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                                  const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
                                  std::optional<double> scale, bool is_causal, const OptionalTensor& cache_batch_idx,
                                  const OptionalTensor& cache_leftpad, int64_t window_left, int64_t window_right,
                                  double softcap, const OptionalTensor& alibi_slopes, const OptionalTensor& lse) {
  const DType dtype = check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale,
                                    cache_batch_idx, cache_leftpad, window_left, window_right, softcap, alibi_slopes,
                                    lse);
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

  // The lengths, starts, cache rows and block ids, read before any kernel: nothing past the cache is ever touched.
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const at::Tensor table = paged ? block_table->contiguous() : at::Tensor();
  const at::Tensor batch_idx = is_given(cache_batch_idx) ? cache_batch_idx->contiguous() : at::Tensor();
  const at::Tensor leftpad = is_given(cache_leftpad) ? cache_leftpad->contiguous() : at::Tensor();
  const int64_t page_size = k_cache.size(2), num_pages = k_cache.size(0);
  const int64_t max_blocks = paged ? table.size(1) : 0;
  const int64_t capacity = paged ? checked_product({max_blocks, page_size}) : k_cache.size(2);
  const int64_t added = append ? k_new->size(2) : 0;
  int64_t max_len = 0;
  std::vector<int64_t> lengths(B);  // paged: the cache rows each sequence reads up to (its appended rows included)
  std::vector<int32_t> appender(batch_idx.defined() && append ? k_cache.size(0) : 0, -1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t cached = seqlens.scalar_type() == at::kLong ? seqlens.data_ptr<int64_t>()[b]
                                                              : seqlens.data_ptr<int32_t>()[b];
    TORCH_CHECK_VALUE(cached >= 0, "cache_seqlens[", b, "] must be >= 0, got ", cached);
    if (paged) {
      TORCH_CHECK_VALUE(cached <= (capacity < 0 ? INT64_MAX : capacity) - added, "block_table: row ", b, " maps ",
                        max_blocks, " blocks of ", page_size, " keys, ", capacity, " keys in all, too few for "
                        "cache_seqlens[", b, "] = ", cached, append ? " plus the " + std::to_string(added) +
                        " new keys of k_new" : std::string());
    } else {
      TORCH_CHECK_VALUE(cached <= capacity - added, "cache_seqlens[", b, "] = ", cached,
                        append ? " plus the " + std::to_string(added) + " new keys of k_new" : std::string(),
                        " exceed the cache's capacity of ", capacity, " keys (k_cache dim 2)");
    }
    const int64_t start = leftpad.defined() ? leftpad.data_ptr<int32_t>()[b] : 0;
    TORCH_CHECK_VALUE(start >= 0 && start <= cached, "cache_leftpad[", b, "] = ", start, " must be in [0, "
                      "cache_seqlens[", b, "] = ", cached, "]: sequence ", b, "'s keys start there and end at its length");
    if (batch_idx.defined()) {
      const int32_t row = batch_idx.data_ptr<int32_t>()[b];
      TORCH_CHECK_INDEX(row >= 0 && row < k_cache.size(0), "cache_batch_idx[", b, "] = ", row,
                        " is not a row of the cache (k_cache has ", k_cache.size(0), " rows, dim 0)");
      if (append) {  // two sequences appending into one cache row: one would see the other's keys
        TORCH_CHECK_VALUE(appender[row] < 0, "cache_batch_idx[", appender[row], "] and cache_batch_idx[", b,
                          "] both name cache row ", row, ", and k_new and v_new are appended: each sequence that "
                          "appends needs a cache row of its own");
        appender[row] = static_cast<int32_t>(b);
      }
    }
    const int64_t length = cached + added;
    max_len = std::max(max_len, length - start);
    lengths[b] = length;
    if (paged) {
      const int32_t* row = table.data_ptr<int32_t>() + b * max_blocks;
      for (int64_t i = start / page_size; i < (length + page_size - 1) / page_size; ++i)
        TORCH_CHECK_INDEX(row[i] >= 0 && row[i] < num_pages, "block_table[", b, ", ", i, "] = ", row[i],
                          " is not a block of the cache (k_cache has ", num_pages, " blocks)");
    }
  }
  if (paged && append) check_appended_rows_unshared(table.data_ptr<int32_t>(), max_blocks, lengths, added, page_size, num_pages);

  const at::Tensor q4 = q.size(3) > 1 && q.stride(3) != 1 ? q.contiguous() : q;
  at::Tensor k_new4, v_new4;
  AttentionParams p;
  fill_params(p, q4, k_cache, v_cache, dtype, scale, "none");
  // The keys and the causal rule are the call's, not the cache's dims (a paged cache is (num_blocks, Hkv,
  // block_size, d)): each sequence's keys end at its own length, bottom-right aligned (the kernel reads cache_seqlens).
  p.kv_len = max_len;
  p.is_causal = is_causal;
  p.window_left = window_bound(window_left, p.q_len + max_len);
  p.window_right = window_bound(window_right, p.q_len + max_len);
  p.softcap = static_cast<float>(softcap);
  if (is_given(alibi_slopes)) {
    p.alibi_slopes = alibi_slopes->data_ptr<float>();
    p.alibi_strides[0] = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
    p.alibi_strides[1] = alibi_slopes->stride(alibi_slopes->dim() - 1);
  }
  p.num_threads = std::max(1, at::get_num_threads());
  p.cache_seqlens = seqlens.data_ptr();
  p.cache_seqlens_int64 = seqlens.scalar_type() == at::kLong;
  if (leftpad.defined()) p.cache_leftpad = leftpad.data_ptr<int32_t>();
  if (batch_idx.defined()) p.cache_batch_idx = batch_idx.data_ptr<int32_t>();
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
    p.new_len = added;
    fill_strides(p.k_new_strides, k_new4);
    fill_strides(p.v_new_strides, v_new4);
  }
  at::Tensor out = checked_empty({B, p.num_heads, Nq, d}, q.options(), "out");
  p.out = out.data_ptr();
  fill_strides(p.out_strides, out);
  if (is_given(lse)) {
    p.lse = lse->data_ptr<float>();
    p.lse_strides[0] = lse->stride(0);
    p.lse_strides[1] = lse->stride(1);
  }
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

// merge_partial_ has no backward: an argument that requires grad is refused, not written behind autograd's back.
void refuse_grad(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  for (size_t i = 0; i < arguments.size() && at::GradMode::is_enabled(); ++i) {
    const c10::IValue& arg = (*stack)[first + i];
    TORCH_CHECK_VALUE(!arg.isTensor() || !arg.toTensor().requires_grad(), op.schema().name(),
                      " has no backward, but ", arguments[i].name(), " requires grad (call it under torch.no_grad())");
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
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
                                                   int64_t, double, const std::optional<at::Tensor>&, double,
                                                   const std::optional<at::Tensor>&);

// Whether autograd would record a call on t: a gradient wanted (grad mode on) or a forward-mode tangent.
bool wants_grad(const at::Tensor& t) {
  return (at::GradMode::is_enabled() && t.requires_grad()) || t._fw_grad(/*level=*/0).defined();
}
// Whether autograd (reverse or forward mode) must record a call on these tensors: then the wrappers take it.
bool autograd_needed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return wants_grad(q) || wants_grad(k) || wants_grad(v);
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
                                         /*dropout_seed=*/std::nullopt, /*softcap=*/0.0,
                                         /*alibi_slopes=*/std::nullopt);
    else
      out = attention_op.call(q, k, v, impl, scale, causal, block_q, block_k);
  }
  if (return_lse) return py::make_tuple(out, lse);
  return py::cast(out);
}

// A Python float or int (not bool) into *value; false for anything else.
bool double_from(py::handle x, double* value) {
  if (!(PyFloat_CheckExact(x.ptr()) || PyLong_CheckExact(x.ptr()))) return false;
  const double v = PyFloat_AsDouble(x.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  *value = v;
  return true;
}

// None or a Python float or int (not bool) that is a finite float32 into *value; false for anything else.
bool scale_from(py::handle scale, std::optional<double>* value) {
  if (scale.is_none()) return true;
  double s = 0.0;
  if (!double_from(scale, &s) || !(std::isfinite(s) && std::fabs(s) < kFloat32Overflow)) return false;
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
  if (!(impl == "flash" || impl == "naive" || impl == "blocked" || impl == "fused" || impl == "flash_teaching"))
    return py::none();
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

// Whether our kernel reads this attn_mask as torch's SDPA would (ops._mask_is_ours): a plain tensor on q's device
// (CPU or CUDA) of bool, float32 or q's dtype, broadcastable to the scores (..., Nq, Nk), for which no gradient
// (reverse or forward) is wanted — torch computes that one.
bool mask_is_ours(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k) {
  if (!plain_dense(mask) || mask.device() != q.device()) return false;
  const auto type = mask.scalar_type();
  if (!(type == at::kBool || type == at::kFloat || type == q.scalar_type())) return false;
  if (wants_grad(mask)) return false;
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

// None or a plain torch.Tensor (not a subclass) into *t; false for anything else.
bool optional_tensor_from(py::handle x, std::optional<at::Tensor>* t) {
  if (x.is_none()) return true;
  if (!THPVariable_CheckExact(x.ptr())) return false;
  *t = THPVariable_Unpack(x.ptr());
  return plain_dense(**t);
}

// cs149gpt.attention_with_kvcache(...) for plain tensors, or None: a decoding step's host work is most of its time at
// batch 1, and this path skips the Python wrapper's checks, the boxed dispatch of 16 arguments and the autograd
// fallback. The operator is called below autograd, so the ADInplaceOrView kernel's part (refuse_forward_ad_and_bump)
// is done here: None for a tangent, the written tensors' versions bumped. The checks of values are the operator's.
py::object kvcache_fast(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& cache_seqlens, py::handle k_new_arg, py::handle v_new_arg,
                        py::handle block_table_arg, py::handle scale_arg, py::handle is_causal,
                        py::handle cache_batch_idx_arg, py::handle cache_leftpad_arg, py::handle window,
                        py::handle softcap_arg, py::handle alibi_slopes_arg, py::handle lse_arg) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("cs149gpt::attention_with_kvcache", "")
                             .typed<decltype(attention_with_kvcache)>();
  if (is_causal.ptr() != Py_True && is_causal.ptr() != Py_False) return py::none();
  std::optional<double> scale;
  double softcap = 0.0;
  if (!scale_from(scale_arg, &scale) || !double_from(softcap_arg, &softcap)) return py::none();
  std::optional<int64_t> window_left = -1, window_right = -1;
  if (!window.is_none()) {  // (left, right), each an int >= -1; the wrapper words anything else
    if (!PyTuple_CheckExact(window.ptr()) || PyTuple_GET_SIZE(window.ptr()) != 2) return py::none();
    window_left.reset();
    window_right.reset();
    if (!int_from(PyTuple_GET_ITEM(window.ptr(), 0), &window_left) || !window_left || *window_left < -1 ||
        !int_from(PyTuple_GET_ITEM(window.ptr(), 1), &window_right) || !window_right || *window_right < -1)
      return py::none();
  }
  std::optional<at::Tensor> k_new, v_new, block_table, cache_batch_idx, cache_leftpad, alibi_slopes, lse;
  if (!optional_tensor_from(k_new_arg, &k_new) || !optional_tensor_from(v_new_arg, &v_new) ||
      !optional_tensor_from(block_table_arg, &block_table) ||
      !optional_tensor_from(cache_batch_idx_arg, &cache_batch_idx) ||
      !optional_tensor_from(cache_leftpad_arg, &cache_leftpad) ||
      !optional_tensor_from(alibi_slopes_arg, &alibi_slopes) || !optional_tensor_from(lse_arg, &lse))
    return py::none();
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &cache_seqlens})
    if (!plain_dense(*t) || wants_grad(*t)) return py::none();  // the wrapper refuses a gradient, the op a tangent
  for (const std::optional<at::Tensor>* t : {&k_new, &v_new, &block_table, &cache_batch_idx, &cache_leftpad,
                                              &alibi_slopes, &lse})
    if (*t && wants_grad(**t)) return py::none();
  at::Tensor out;
  {
    py::gil_scoped_release no_gil;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op.call(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale, is_causal.ptr() == Py_True,
                  cache_batch_idx, cache_leftpad, *window_left, *window_right, softcap, alibi_slopes, lse);
  }
  torch::autograd::impl::bump_version(k_cache);
  torch::autograd::impl::bump_version(v_cache);
  if (lse) torch::autograd::impl::bump_version(*lse);
  return py::cast(out);
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
        "Tensor? dropout_seed=None, float softcap=0.0, Tensor? alibi_slopes=None) -> (Tensor out, Tensor lse)",
        keep_stride_order);
  m.def("flash_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "float? scale=None, str causal='none', int? block_q=None, int? block_k=None, Tensor? attn_mask=None, "
        "int window_left=-1, int window_right=-1, float dropout_p=0.0, Tensor? dropout_seed=None, "
        "float softcap=0.0, Tensor? alibi_slopes=None) -> (Tensor dq, Tensor dk, Tensor dv)", keep_stride_order);
  m.def("varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
        "int max_seqlen_k, float? scale=None, bool causal=False, int window_left=-1, int window_right=-1, "
        "float dropout_p=0.0, Tensor? dropout_seed=None, float softcap=0.0, Tensor? alibi_slopes=None, "
        "Tensor? block_table=None) -> (Tensor out, Tensor lse)");
  m.def("varlen_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float? scale=None, "
        "bool causal=False, int window_left=-1, int window_right=-1, float dropout_p=0.0, Tensor? dropout_seed=None, "
        "float softcap=0.0, Tensor? alibi_slopes=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("attention_with_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
        "Tensor? k_new=None, Tensor? v_new=None, Tensor? block_table=None, float? scale=None, bool is_causal=True, "
        "Tensor? cache_batch_idx=None, Tensor? cache_leftpad=None, int window_left=-1, int window_right=-1, "
        "float softcap=0.0, Tensor? alibi_slopes=None, Tensor(c!)? lse=None) -> Tensor");
  m.def("merge_partial_(Tensor(a!) out, Tensor(b!) lse, Tensor out_block, Tensor lse_block) -> ()");
}

TORCH_LIBRARY_IMPL(cs149gpt, CPU, m) {
  m.impl("attention", &cs149gpt::attention);
  m.impl("flash_attention", &cs149gpt::flash_attention);
  m.impl("flash_attention_backward", &cs149gpt::flash_attention_backward);
  m.impl("attention_with_kvcache", &cs149gpt::attention_with_kvcache);
  m.impl("varlen_attention", &cs149gpt::varlen_attention);
  m.impl("varlen_attention_backward", &cs149gpt::varlen_attention_backward);
  m.impl("merge_partial_", &cs149gpt::merge_partial_);
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

TORCH_LIBRARY_IMPL(cs149gpt, Autograd, m) {
  m.impl("merge_partial_", torch::CppFunction::makeFromBoxedFunction<&cs149gpt::refuse_grad>());
}

TORCH_LIBRARY_IMPL(cs149gpt, ADInplaceOrView, m) {
  for (const char* op : {"attention", "flash_attention", "flash_attention_backward", "varlen_attention",
                         "varlen_attention_backward"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&cs149gpt::refuse_forward_ad>());
  for (const char* op : {"attention_with_kvcache", "merge_partial_"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&cs149gpt::refuse_forward_ad_and_bump>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace cs149gpt;
  namespace py = pybind11;
  m.doc() = "cs149gpt: CPU attention kernels (naive, blocked, fused, flash, flash_teaching)";
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
                              int64_t window_right, double dropout_p, const OptionalTensor& dropout_seed,
                              double softcap, const OptionalTensor& alibi_slopes) {
    check_attention(q, k, v, parse_impl(impl), scale, causal, block_q, block_k, attn_mask, window_left, window_right,
                    dropout_p, dropout_seed, softcap, alibi_slopes);
  }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("impl"), py::arg("scale"), py::arg("causal"),
     py::arg("block_q"), py::arg("block_k"), py::arg("attn_mask") = py::none(), py::arg("window_left") = -1,
     py::arg("window_right") = -1, py::arg("dropout_p") = 0.0, py::arg("dropout_seed") = py::none(),
     py::arg("softcap") = 0.0, py::arg("alibi_slopes") = py::none(), "raises what torch.ops.cs149gpt.attention would for these arguments, on sizes alone (meta and fake tensors too)");
  m.def("check_attention_backward", [](const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                       std::optional<double> scale, const std::string& causal,
                                       std::optional<int64_t> block_q, std::optional<int64_t> block_k,
                                       const OptionalTensor& attn_mask, int64_t window_left, int64_t window_right,
                                       double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                                       const OptionalTensor& alibi_slopes) {
    check_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k, attn_mask, window_left,
                             window_right, dropout_p, dropout_seed, softcap, alibi_slopes);
  }, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("scale"),
     py::arg("causal"), py::arg("block_q"), py::arg("block_k"), py::arg("attn_mask") = py::none(),
     py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("dropout_p") = 0.0,
     py::arg("dropout_seed") = py::none(), py::arg("softcap") = 0.0, py::arg("alibi_slopes") = py::none(),
     "raises what torch.ops.cs149gpt.flash_attention_backward would for these arguments, on sizes alone");
  m.def("check_merge", [](const at::Tensor& out, const at::Tensor& lse, const at::Tensor& out_block,
                          const at::Tensor& lse_block) { check_merge(out, lse, out_block, lse_block); },
        py::arg("out"), py::arg("lse"), py::arg("out_block"), py::arg("lse_block"),
        "raises what torch.ops.cs149gpt.merge_partial_ would for these arguments, on sizes alone");
  m.def("check_varlen", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                           const at::Tensor& cu_k, int64_t max_q, int64_t max_k, std::optional<double> scale,
                           bool causal, int64_t window_left, int64_t window_right, double dropout_p,
                           const OptionalTensor& dropout_seed, double softcap, const OptionalTensor& alibi_slopes,
                           const OptionalTensor& block_table) {
    check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right, dropout_p, dropout_seed,
                 softcap, alibi_slopes, block_table);
  }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
     py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("scale"), py::arg("causal"), py::arg("window_left"),
     py::arg("window_right"), py::arg("dropout_p"), py::arg("dropout_seed"), py::arg("softcap"),
     py::arg("alibi_slopes"), py::arg("block_table") = py::none(),
     "raises what torch.ops.cs149gpt.varlen_attention would for these arguments, on sizes alone");
  m.def("check_varlen_backward", [](const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                    const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q, int64_t max_k,
                                    std::optional<double> scale, bool causal, int64_t window_left,
                                    int64_t window_right, double dropout_p, const OptionalTensor& dropout_seed,
                                    double softcap, const OptionalTensor& alibi_slopes) {
    check_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right,
                          dropout_p, dropout_seed, softcap, alibi_slopes);
  }, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
     py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
     py::arg("scale"), py::arg("causal"), py::arg("window_left"), py::arg("window_right"), py::arg("dropout_p"),
     py::arg("dropout_seed"), py::arg("softcap"), py::arg("alibi_slopes"),
     "raises what torch.ops.cs149gpt.varlen_attention_backward would for these arguments, on sizes alone");
  m.def("check_attention_with_kvcache", [](const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                           const at::Tensor& cache_seqlens, const OptionalTensor& k_new,
                                           const OptionalTensor& v_new, const OptionalTensor& block_table,
                                           std::optional<double> scale, const OptionalTensor& cache_batch_idx,
                                           const OptionalTensor& cache_leftpad, int64_t window_left,
                                           int64_t window_right, double softcap, const OptionalTensor& alibi_slopes,
                                           const OptionalTensor& lse) {
    check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale, cache_batch_idx, cache_leftpad,
                  window_left, window_right, softcap, alibi_slopes, lse);
  }, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("cache_seqlens"), py::arg("k_new") = py::none(),
     py::arg("v_new") = py::none(), py::arg("block_table") = py::none(), py::arg("scale") = py::none(),
     py::arg("cache_batch_idx") = py::none(), py::arg("cache_leftpad") = py::none(), py::arg("window_left") = -1,
     py::arg("window_right") = -1, py::arg("softcap") = 0.0, py::arg("alibi_slopes") = py::none(),
     py::arg("lse") = py::none(),
     "raises what torch.ops.cs149gpt.attention_with_kvcache would for these arguments, on sizes alone");
  m.def("attention_fast", &attention_fast, "cs149gpt.attention's eager path for plain tensors (None: not taken)");
  m.def("kvcache_fast", &kvcache_fast,
        "cs149gpt.attention_with_kvcache's eager path for plain tensors (None: not taken)");
  m.def("sdpa_fast", &sdpa_fast,
        "cs149gpt.scaled_dot_product_attention's eager path without dropout (None: not taken)");
  m.def("isa", &isa, "the instruction set the kernels run with: amx, avx512_bf16, avx512, avx2, scalar or amx_emulated");
  m.def("set_float32_products", [](const std::string& how) {
    TORCH_CHECK_VALUE(how == "auto" || how == "fma" || how == "bf16_tiles",
                      "how must be 'auto', 'fma' or 'bf16_tiles'; got '", how, "'");
    g_float32_products = how == "fma" ? F32Products::fma
                         : how == "bf16_tiles" ? F32Products::bf16_tiles : F32Products::automatic;
  }, "force how the flash forward multiplies float32 where the ISA has AMX tiles: float32 FMAs ('fma'), or the bf16 "
     "tiles with each operand in three bf16 parts ('bf16_tiles': 1.1-1.25x faster on one thread at head_dim >= 96, "
     "slower on 8 and 16); 'auto' (the default): FMAs");
  m.def("amx_unavailable_reason", [] { return std::string(amx_unavailable_reason()); },
        "why the AMX kernels are not used on a CPU that has AMX (the kernel refused the permission), or ''");
  // Knobs and probes that exist for tests and measurements: cs149gpt._C._testing (testing.cpp).
  testing::register_testing(m);
}
