// Every argument check of the operators, and the filling of the params struct: the one check path of the CPU ops
// (module.cpp), their fake (meta) implementations (ops.py, through the module's check_* bindings) and the CUDA ops
// (cuda/flash_api.cpp). A wrong input gets the same message on each. Checks on sizes are written on symbolic sizes
// (SymInt), so FakeTensors under torch.compile go through the same code as real tensors.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"

namespace cs149gpt {

enum class Impl { naive, blocked, fused, flash, flash_teaching };

Impl parse_impl(const std::string& impl);
const char* impl_name(Impl impl);
// causal ("none", "top_left", "bottom_right") as params: sets *is_causal, returns causal_offset.
int64_t parse_causal(const std::string& causal, int64_t q_len, int64_t kv_len, bool* is_causal);
DType parse_dtype(const at::Tensor& q, Impl impl);

// A condition on sizes that may be symbolic (torch.compile): decided now when it can be (concrete sizes; backed
// symbols, with a guard), else asserted when the compiled graph runs (unbacked sizes, from data-dependent ops such
// as nonzero, where a guard would fail the trace).
#define CHECK_SIZES(cond, ...) TORCH_CHECK_VALUE((cond).expect_true(__FILE__, __LINE__), __VA_ARGS__)
c10::SymBool equal_sizes(c10::SymIntArrayRef a, c10::SymIntArrayRef b);

// Python floats are doubles; the kernels take scale as a float32. Doubles from this bound up round to ±inf
// (it is FLT_MAX + half an ulp), so the comparison is made in double, without an out-of-range conversion.
constexpr double kFloat32Overflow = 0x1.ffffffp+127;

using OptionalTensor = std::optional<at::Tensor>;
inline bool is_given(const OptionalTensor& t) { return t.has_value() && t->defined(); }

// A plain dense tensor of at least 2 dims (sparse, nested and quantized ones refused by name).
void check_tensor(const at::Tensor& t, const char* name);
// All tensors of one call on one device: the CPU, meta (shapes only, for tracing) or one CUDA GPU.
void check_devices(std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors);
// attn_mask (torch SDPA's): dense, bool or additive (float32 or q's dtype), broadcastable to (..., Nq, Nk).
void check_mask(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k);

// Every check of an attention call that needs no data: dtypes, devices, ranks, shapes (GQA divisibility included),
// scale, causal mode, tiles, and the options each impl takes. Returns the dtype of the call.
DType check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Impl impl,
                      std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                      std::optional<int64_t> block_k, const OptionalTensor& attn_mask = {}, int64_t window_left = -1,
                      int64_t window_right = -1, double dropout_p = 0.0, const OptionalTensor& dropout_seed = {},
                      double softcap = 0.0, const OptionalTensor& alibi_slopes = {});
// t is dense with like's shape and dtype.
void check_like(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name);
// The backward's: the forward's checks on q, k, v, then dout and out shaped like q, lse like q without its last dim,
// float32; all six on one device.
DType check_attention_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& out, const at::Tensor& lse, std::optional<double> scale,
                               const std::string& causal, std::optional<int64_t> block_q,
                               std::optional<int64_t> block_k, const OptionalTensor& attn_mask = {},
                               int64_t window_left = -1, int64_t window_right = -1, double dropout_p = 0.0,
                               const OptionalTensor& dropout_seed = {}, double softcap = 0.0,
                               const OptionalTensor& alibi_slopes = {});
// varlen_attention's checks on sizes (symbolic: the fake calls it too): q (total_q, Hq, d), k and v (total_k, Hkv, d),
// cu_seqlens_q and cu_seqlens_k int32 of one size B + 1 >= 2, max_seqlen_q/k >= 0, and the options check_attention
// checks too (the same code); messages show the shapes as passed. total_q and total_k may be 0 (FlashAttention's: empty
// out, zero gradients). Returns the dtype of the call. The sequences' lengths are checked when the data is
// read (varlen_lengths).
// With block_table (B, max_blocks) int32, a paged KV cache: k and v are (num_blocks, page_block_size, Hkv, d) instead.
DType check_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                   const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                   std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
                   double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                   const OptionalTensor& alibi_slopes, const OptionalTensor& block_table = {});
// The varlen backward's: check_varlen's checks, then dout and out shaped like q, lse (heads, total_q) float32; all six on
// one device.
DType check_varlen_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
                            const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                            std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right,
                            double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                            const OptionalTensor& alibi_slopes);
// The longest query and key sequences of cu_seqlens_q/k, after checking them against the packed tensors: each starts at
// >= 0, never decreases, ends within total_q/total_k rows, and no sequence is longer than max_seqlen_q/k. `covers` is
// set to whether the sequences cover every row of q and of k (else the rows outside them get zeros).
std::pair<int64_t, int64_t> varlen_lengths(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                           int64_t total_q, int64_t total_k, int64_t max_seqlen_q,
                                           int64_t max_seqlen_k, bool* covers);

// A paged varlen call's pages, read: sequence b's keys (cu_seqlens_k[b + 1] − cu_seqlens_k[b], checked by
// varlen_lengths) take its first ceil(keys / page_size) blocks of block_table's row b, which must exist (ValueError)
// and be in [0, num_blocks) (IndexError), both naming block_table.
void check_varlen_pages(const at::Tensor& block_table, const at::Tensor& cu_seqlens_k, int64_t page_size,
                        int64_t num_blocks);

// attention_with_kvcache's checks on sizes (symbolic: the fake calls it too). Returns the dtype of the call.
DType check_kvcache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& cache_seqlens, const OptionalTensor& k_new, const OptionalTensor& v_new,
                    const OptionalTensor& block_table, std::optional<double> scale,
                    const OptionalTensor& cache_batch_idx = {}, const OptionalTensor& cache_leftpad = {},
                    int64_t window_left = -1, int64_t window_right = -1, double softcap = 0.0,
                    const OptionalTensor& alibi_slopes = {}, const OptionalTensor& lse = {});
// A paged cache appended to: no appended row may be seen by another sequence (or twice by its own).
void check_appended_rows_unshared(const int32_t* table, int64_t max_blocks, const std::vector<int64_t>& lengths,
                                  int64_t added, int64_t page_size, int64_t num_pages);

// merge_partial_'s checks (symbolic: the fake calls it too): out (batch, heads, rows, head_dim) float32 and lse
// (batch, heads, rows) float32, both written in place; out_block like out in float32, bfloat16 or float16, lse_block
// like lse; last dims contiguous; one device. Returns out_block's dtype.
DType check_merge(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& out_block,
                  const at::Tensor& lse_block);
MergeParams merge_params(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& out_block,
                         const at::Tensor& lse_block, DType dtype);

// ---- memory: sizes that overflow int64 or exceed the machine are refused before anything is allocated ----
int64_t physical_memory_bytes();
// Sizes arithmetic that says when it leaves int64: -1 then (sizes are never negative, so -1 propagates).
int64_t checked_product(at::IntArrayRef factors);
int64_t checked_sum(at::IntArrayRef terms);
std::string gib(double bytes);
std::string shape_of(const char* name, at::IntArrayRef sizes);

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
// naive and blocked materialise the q_len × kv_len score matrix: refused up front when it cannot fit.
void check_score_matrix_fits(int64_t q_len, int64_t kv_len, const char* impl);
// An output of these sizes (the kernels write every element), checked before it is allocated.
at::Tensor checked_empty(at::IntArrayRef sizes, const at::TensorOptions& options, const char* name);

// ---- the params struct ----
// (..., N, d) as (batch, heads, N, d): a view where the strides allow, a checked copy otherwise (and where the last
// dim is strided: SIMD loads need the head_dim columns contiguous).
at::Tensor as_4d(const at::Tensor& t, const char* name);
// attn_mask as (batch, heads, Nq, Nk): expanded (stride 0 along the broadcast dims), leading dims flattened.
at::Tensor mask_as_4d(const at::Tensor& mask, const at::Tensor& q, int64_t kv_len);
void fill_strides(int64_t (&strides)[3], const at::Tensor& t4);
// The params every forward shares, from (batch, heads, N, d) views of q, k, v: pointers, strides, sizes, scale
// (1/√d unless given) and the causal mask. The CPU's prepare and the CUDA one both start here.
void fill_params(AttentionParams& p, const at::Tensor& q4, const at::Tensor& k4, const at::Tensor& v4, DType dtype,
                 std::optional<double> scale, const std::string& causal);

// The params of the options, alike for a dense call (prepare) and a varlen one (module.cpp, prepare_varlen), set after
// p.batch and p.num_heads: threads, float32's products, the window (a bound past q_len + kv_len, the longest sequences'
// for varlen, is none), dropout's seed, softcap and the ALiBi slopes, seen as (batch, Hq) (returned: p.alibi_slopes
// points into it; undefined without slopes). Not the window's offset: a dense call's own, a varlen call's per sequence.
// A window bound that reaches past every key leaves its side unbounded (−1): row i's band is i + offset ± bound in
// int64 (attention.h), which a bound near INT64_MAX — sys.maxsize meaning "no bound" — would overflow. Exact: with
// |offset| < q_len + kv_len, a bound beyond q_len + kv_len hides no key.
inline int64_t window_bound(int64_t bound, int64_t q_len_plus_kv_len) {
  return bound > q_len_plus_kv_len ? int64_t{-1} : bound;
}
at::Tensor fill_options(AttentionParams& p, int64_t q_len_plus_kv_len, int64_t window_left, int64_t window_right,
                        double dropout_p, const OptionalTensor& dropout_seed, double softcap,
                        const OptionalTensor& alibi_slopes);

// How the CPU forward multiplies float32 on AMX (the module's set_float32_products).
extern F32Products g_float32_products;

// q, k, v checked and seen as (batch, heads, N, d), with the params of a CPU call on them (all but out and lse).
struct Prepared {
  at::Tensor q4, k4, v4;  // views (or, for a strided last dim, copies) that the params point into
  at::Tensor mask4;       // attn_mask expanded to (batch, heads, Nq, Nk): a view, stride 0 where broadcast
  at::Tensor key_ranges;  // attn_mask's runs of shown keys, when each row has one (mask_ranges.cpp)
  at::Tensor alibi;       // alibi_slopes as (Hq,) or (batch, Hq): what p.alibi_slopes points into
  AttentionParams p;
};
// Fills the params of a CPU call whose arguments check_attention has passed (it returned dtype).
Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Impl impl, DType dtype,
                 std::optional<double> scale, const std::string& causal, std::optional<int64_t> block_q,
                 std::optional<int64_t> block_k, const OptionalTensor& attn_mask = {}, int64_t window_left = -1,
                 int64_t window_right = -1, double dropout_p = 0.0, const OptionalTensor& dropout_seed = {},
                 double softcap = 0.0, const OptionalTensor& alibi_slopes = {});

}  // namespace cs149gpt
