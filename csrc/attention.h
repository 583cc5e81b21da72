// The one contract between the checks (checks.cpp) and every attention kernel.
//
// A kernel reads q, k, v in place through element strides and writes `out` the same way: no tensor is
// copied, transposed or made contiguous on the way in. Any layout torch can describe with strides works,
// including the views a GPT makes with x.view(B, T, H, d).transpose(1, 2).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

// What the CUDA kernels share with the CPU's (sequence_view, dropout's generator): host and device functions under nvcc.
#ifdef __CUDACC__
#define CS149GPT_HOST_DEVICE __host__ __device__
#else
#define CS149GPT_HOST_DEVICE
#endif

namespace cs149gpt {

enum class DType { f32, bf16, f16 };  // q, k, v and out share one; arithmetic is always float32

// torch SDPA's attn_mask: none; boolean (true = the key takes part); additive (added to the scaled logits).
enum class MaskKind { none, boolean, additive };

// How the forward multiplies float32 on AMX (AttentionParams::f32_products): module.cpp's set_float32_products.
enum class F32Products { automatic, fma, bf16_tiles };

// Strides are in elements, in the order [batch, head, row]. Within a row the head_dim columns are
// contiguous (checks.cpp guarantees it; SIMD loads need it).
struct AttentionParams {
  const void* q = nullptr;  // (batch, num_heads,    q_len,  head_dim)
  const void* k = nullptr;  // (batch, num_kv_heads, kv_len, head_dim)
  const void* v = nullptr;  // (batch, num_kv_heads, kv_len, head_dim)
  void* out = nullptr;      // (batch, num_heads,    q_len,  head_dim)
  float* lse = nullptr;     // (batch, num_heads, q_len) float32 logsumexp of each row's logits; may be null
  DType dtype = DType::f32;
  int64_t q_strides[3] = {0, 0, 0};
  int64_t k_strides[3] = {0, 0, 0};
  int64_t v_strides[3] = {0, 0, 0};
  int64_t out_strides[3] = {0, 0, 0};
  int64_t lse_strides[2] = {0, 0};  // [batch, head]; rows contiguous

  int64_t batch = 0;
  int64_t num_heads = 0;     // query heads
  int64_t num_kv_heads = 0;  // key/value heads; query head h reads kv head h / (num_heads / num_kv_heads)
  int64_t q_len = 0;
  int64_t kv_len = 0;
  int64_t head_dim = 0;

  float scale = 1.0f;  // logits are scale * q·k
  // Causal mask: query row i sees key j only if j <= i + causal_offset.
  // offset 0 is torch SDPA's is_causal (top-left); kv_len - q_len aligns the mask to the bottom-right.
  bool is_causal = false;
  int64_t causal_offset = 0;

  // attn_mask, as torch SDPA's, read in place: entry (b, h, i, j) (h a query head) is at mask + b·mask_strides[0] +
  // h·mask_strides[1] + i·mask_strides[2] + j·mask_strides[3] elements (stride 0 along the dims it is broadcast
  // over). boolean: bytes, 0 hides key j from row i; additive: mask_dtype values added to scale·q·k, −inf hides.
  // A key hidden by it is hidden as the causal mask hides one (both apply together): it never touches the row.
  const void* mask = nullptr;
  MaskKind mask_kind = MaskKind::none;
  DType mask_dtype = DType::f32;  // additive masks: float32 or q's dtype
  int64_t mask_strides[4] = {0, 0, 0, 0};

  // Sliding window (local attention, FlashAttention's window_size): row i sees key j only if
  // i + window_offset − window_left <= j <= i + window_offset + window_right; −1 leaves that side unbounded.
  // window_offset is kv_len − q_len (FlashAttention aligns the window bottom-right). Applies with both masks.
  int64_t window_left = -1, window_right = -1;
  int64_t window_offset = 0;

  // A boolean attn_mask whose every row shows one run of consecutive keys (padding, left or right; padding and a
  // causal pattern; a band) arrives as that run instead (mask_ranges.cpp, key_ranges_of): row i of query head h in batch
  // b sees keys [key_ranges[o], key_ranges[o + 1]) with o = b·key_range_strides[0] + h·key_range_strides[1] +
  // i·key_range_strides[2] (0 along the dims the mask is broadcast over); an empty run, [0, 0), for a row it hides
  // whole. It narrows the window, so the kernels treat it as one: no mask entry is read again, and only the tiles
  // its edges cut build a bias row.
  const int64_t* key_ranges = nullptr;
  int64_t key_range_strides[3] = {0, 0, 0};

  // Dropout on the attention weights: P_ij is kept (and scaled by 1 / (1 − dropout_p)) where dropout_keep(...) of
  // its counter says so, else zeroed; lse and the softmax's normaliser are those of the undropped P.
  float dropout_p = 0.0f;
  uint64_t dropout_seed = 0, dropout_offset = 0;

  // softcap > 0: each scaled logit s becomes softcap · tanh(s / softcap) (FlashAttention's and Gemma 2's definition),
  // before attn_mask and ALiBi are added; 0 leaves the logits as they are.
  float softcap = 0.0f;
  // ALiBi: float32 slopes, that of query head h in batch b at alibi_slopes[b·alibi_strides[0] + h·alibi_strides[1]]
  // (stride 0 over b for (H,) slopes); adds −slope · |i + kv_len − q_len − j| to row i's scaled logit of key j
  // (FlashAttention's definition, whatever the causal alignment), computed where it is used, never stored.
  const float* alibi_slopes = nullptr;
  int64_t alibi_strides[2] = {0, 0};

  // Packed variable-length sequences (FlashAttention's varlen layout): with cu_seqlens_q set, batch counts sequences,
  // sequence b's queries are rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and out and its keys rows
  // [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v (strides[0] unused: rows are strides[2] apart), and q_len, kv_len
  // are the longest sequence's. Causal masks and windows align bottom-right per sequence. Kernels take one sequence at
  // a time through sequence_view (below). lse is (num_heads, total_q): lse_strides[1] apart, rows at cu_seqlens_q[b].
  // With block_table set (a paged KV cache, below) only the lengths of cu_seqlens_k count: sequence b's keys are
  // 0 .. cu_seqlens_k[b + 1] − cu_seqlens_k[b] − 1 of its pages, read through kv_row.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  // The rows of the packed q and of k and v (0 where unknown): the bounds of the Hopper kernels' tensor maps.
  int64_t total_q = 0, total_k = 0;
  // A call on some of a packed batch's sequences: sequence b then starts at cu_seqlens_q[b] (cu_seqlens_k[b]) and ends
  // at seq_end_q[b] (seq_end_k[b]) rather than at the next sequence's start. dropout_key_stride: the batch's longest key
  // sequence, which dropout's numbering multiplies by (sequence_view; 0: kv_len).
  const int32_t* seq_end_q = nullptr;
  const int32_t* seq_end_k = nullptr;
  int64_t dropout_key_stride = 0;

  // Tile sizes: Br x Bc for flash; the cache tile of the matrix multiplies for blocked. Always >= 1.
  int64_t block_q = 1;
  int64_t block_k = 1;

  int num_threads = 1;  // OpenMP threads the kernel may use; its workspace is sized for this many

  // float32's two products on AMX: in float32 FMAs (flash.cpp), or on the bf16 tiles with every operand in three
  // bf16 parts (flash_bf16.cpp, takes_float32); automatic: FMAs. Results are float32's either way.
  F32Products f32_products = F32Products::automatic;

  // A KV cache (attention_with_kvcache; read by flash_decode.cpp only, null/0 everywhere else).
  // Per-sequence lengths: sequence b's keys are rows [cache_leftpad[b], cache_seqlens[b]) of its cache (int32 or int64
  // lengths; leftpad 0 when null), plus new_len more when k_new is set. Keys are counted from cache_leftpad[b]: key t
  // of sequence b is cache row cache_leftpad[b] + t. It sees seq_kv_len(p, b) keys, kv_len being their maximum, and
  // its causal mask and window are aligned bottom-right to its own length (offset seq_kv_len − q_len).
  const void* cache_seqlens = nullptr;
  bool cache_seqlens_int64 = false;
  const int32_t* cache_leftpad = nullptr;
  // Contiguous cache: sequence b reads (and appends to) cache row cache_batch_idx[b] (k_strides[0] apart); null: b.
  const int32_t* cache_batch_idx = nullptr;
  // Paged cache: k and v are (num_pages, num_kv_heads, page_size, head_dim), k_strides[0] apart; cache row r of
  // sequence b is row r % page_size of page block_table[b · block_table_stride + r / page_size]. Also read by the
  // flash forwards for packed sequences (cu_seqlens_q set): key t of sequence b is cache row t (kv_row).
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int64_t page_size = 0;
  int64_t num_pages = 0;
  // New keys and values, (batch, num_kv_heads, new_len, head_dim): written into the cache at rows
  // [cache_seqlens[b], cache_seqlens[b] + new_len) before attending (k and v are then written, not only read).
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t new_len = 0;
  int64_t k_new_strides[3] = {0, 0, 0};
  int64_t v_new_strides[3] = {0, 0, 0};
};

// Keys of sequence b: its own length with a KV cache, else kv_len.
inline int64_t seq_kv_len(const AttentionParams& p, int64_t b) {
  if (!p.cache_seqlens) return p.kv_len;
  const int64_t cached = p.cache_seqlens_int64 ? static_cast<const int64_t*>(p.cache_seqlens)[b]
                                               : static_cast<const int32_t*>(p.cache_seqlens)[b];
  return cached - (p.cache_leftpad ? p.cache_leftpad[b] : 0) + (p.k_new ? p.new_len : 0);
}

// Sequence b of a packed variable-length call (cu_seqlens_q set) as a dense call of that one sequence, for a kernel's
// task to read as it reads any other: its lengths, causal mask and window bottom-right in it, and q, k, v, out, lse
// moved to its first rows with strides[0] = 0, so that `b · strides[0]` lands there while b keeps indexing the
// kernel's workspace and (batch, head) slopes (a paged k and v stay where they are: block_table moves to b's row, so
// that kv_row's `b · block_table_stride` lands there). Its dropout counters stay distinct from every other sequence's: entry
// (h, i, j) of sequence b gets ((cu_seqlens_q[b] · num_heads) · kv_len + (h · q_len_b + i) · kv_len_b + j) + offset,
// kv_len being the batch's longest key sequence (dropout_key_stride; attention.h's numbering below, with the offset
// moved), whatever group of the batch's sequences a call runs. A dense call is its own view.
// The CUDA kernels take it in each block's prologue (cu_seqlens, seq_end and block_table then in device memory).
CS149GPT_HOST_DEVICE inline int64_t element_bytes(DType t) { return t == DType::f32 ? 4 : 2; }
template <class P>
CS149GPT_HOST_DEVICE inline P* rows_on(P* base, DType t, int64_t rows, int64_t row_stride) {
  using Byte = std::conditional_t<std::is_const_v<P>, const char, char>;
  return base ? reinterpret_cast<P*>(reinterpret_cast<Byte*>(base) + rows * row_stride * element_bytes(t)) : base;
}
CS149GPT_HOST_DEVICE inline AttentionParams sequence_view(const AttentionParams& p, int64_t b) {
  if (!p.cu_seqlens_q) return p;
  AttentionParams s = p;
  const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
  s.q_len = (p.seq_end_q ? p.seq_end_q[b] : p.cu_seqlens_q[b + 1]) - q0;
  s.kv_len = (p.seq_end_k ? p.seq_end_k[b] : p.cu_seqlens_k[b + 1]) - k0;
  s.causal_offset = s.window_offset = s.kv_len - s.q_len;
  s.q = rows_on(p.q, p.dtype, q0, p.q_strides[2]);
  s.out = rows_on(p.out, p.dtype, q0, p.out_strides[2]);
  s.q_strides[0] = s.out_strides[0] = 0;
  if (p.block_table) {  // paged: k and v stay, pages k_strides[0] apart; the table moves to b's row instead
    s.block_table = p.block_table + b * p.block_table_stride;
    s.block_table_stride = 0;
  } else {
    s.k = rows_on(p.k, p.dtype, k0, p.k_strides[2]);
    s.v = rows_on(p.v, p.dtype, k0, p.v_strides[2]);
    s.k_strides[0] = s.v_strides[0] = 0;
  }
  if (p.lse) s.lse = p.lse + q0;
  s.lse_strides[0] = 0;
  const uint64_t heads = static_cast<uint64_t>(p.num_heads);
  const uint64_t key_stride = static_cast<uint64_t>(p.dropout_key_stride > 0 ? p.dropout_key_stride : p.kv_len);
  s.dropout_offset = p.dropout_offset + static_cast<uint64_t>(q0) * heads * key_stride -
                     static_cast<uint64_t>(b) * heads * static_cast<uint64_t>(s.q_len) * static_cast<uint64_t>(s.kv_len);
  s.cu_seqlens_q = s.cu_seqlens_k = s.seq_end_q = s.seq_end_k = nullptr;
  return s;
}

// Key t of kv head kvh in sequence (or batch) b of k or v (base and strides: p.k and p.k_strides, or p.v and
// p.v_strides), and in *run how many keys from t on follow it strides[2] apart: with a paged cache (block_table), key t
// is row t % page_size of page block_table[b · block_table_stride + t / page_size] and the run ends with its page;
// otherwise every key follows. The flash forwards pack K and V through it, a run at a time.
template <class T>
inline const T* kv_row(const AttentionParams& p, const void* base, const int64_t (&strides)[3], int64_t b, int64_t kvh,
                       int64_t t, int64_t* run) {
  if (!p.block_table) {
    *run = INT64_MAX;
    return static_cast<const T*>(base) + b * strides[0] + kvh * strides[1] + t * strides[2];
  }
  const int64_t page = p.block_table[b * p.block_table_stride + t / p.page_size], row = t % p.page_size;
  *run = p.page_size - row;
  return static_cast<const T*>(base) + page * strides[0] + kvh * strides[1] + row * strides[2];
}

// The first row of head `h` in batch `b` of each tensor; row i then starts i * <tensor>_strides[2] further.
// A query head reads the key/value head of its group (GQA): h / (num_heads / num_kv_heads).
// Kernels take these once per (batch, head), outside their inner loops. T is the element type.
inline int64_t kv_head(const AttentionParams& p, int64_t h) { return h / (p.num_heads / p.num_kv_heads); }
template <class T>
const T* q_head(const AttentionParams& p, int64_t b, int64_t h) {
  return static_cast<const T*>(p.q) + b * p.q_strides[0] + h * p.q_strides[1];
}
template <class T>
const T* k_head(const AttentionParams& p, int64_t b, int64_t h) {
  return static_cast<const T*>(p.k) + b * p.k_strides[0] + kv_head(p, h) * p.k_strides[1];
}
template <class T>
const T* v_head(const AttentionParams& p, int64_t b, int64_t h) {
  return static_cast<const T*>(p.v) + b * p.v_strides[0] + kv_head(p, h) * p.v_strides[1];
}
template <class T>
T* out_head(const AttentionParams& p, int64_t b, int64_t h) {
  return static_cast<T*>(p.out) + b * p.out_strides[0] + h * p.out_strides[1];
}

// Number of keys query row i may attend to: keys [0, visible_keys(i)).
inline int64_t visible_keys(const AttentionParams& p, int64_t i) {
  if (!p.is_causal) return p.kv_len;
  int64_t last = i + p.causal_offset;  // last visible key
  if (last < 0) return 0;
  return last + 1 < p.kv_len ? last + 1 : p.kv_len;
}

// Dropout's generator: counter-based, so that the backward regenerates the forward's mask without storing it, and
// any thread computes any element. Entry (b, h, i, j) (b the flattened batch, h the query head) has the counter
// ((b · heads + h) · q_len + i) · kv_len + j; its 32-bit uniform is the high half of splitmix64's finalizer of
// seed_key + (counter + offset) · γ (a Weyl sequence keyed by the seed), and it is kept when that is >= p · 2³².
// The same distribution as torch's dropout (independent Bernoulli(1 − p) keeps), not the same bits.
CS149GPT_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
CS149GPT_HOST_DEVICE inline uint64_t dropout_threshold(float p) {  // keep u (32 bits) iff u >= threshold
  return static_cast<uint64_t>(static_cast<double>(p) * 4294967296.0);
}
CS149GPT_HOST_DEVICE inline bool dropout_keep(uint64_t seed_key, uint64_t counter, uint64_t threshold) {
  return (mix64(seed_key + counter * 0x9E3779B97F4A7C15ull) >> 32) >= threshold;
}
CS149GPT_HOST_DEVICE inline uint64_t dropout_seed_key(uint64_t seed) { return mix64(seed + 0x632BE59BD9B4E019ull); }

// A window: the sliding window, attn_mask's key ranges, or both.
inline bool has_window(const AttentionParams& p) {
  return p.window_left >= 0 || p.window_right >= 0 || p.key_ranges != nullptr;
}
// Whether anything beyond the causal mask hides keys (attn_mask, a window): the kernels then classify their blocks.
inline bool has_mask_or_window(const AttentionParams& p) { return p.mask_kind != MaskKind::none || has_window(p); }
// Whether the logits are transformed before attn_mask is added (softcap, ALiBi): every score the kernels compute.
inline bool has_logit_mods(const AttentionParams& p) { return p.softcap > 0.0f || p.alibi_slopes != nullptr; }

// The keys of row i's window (query head h, batch b): [window_first, window_last] (unclamped; INT64 extremes when
// unbounded), the sliding window's band within attn_mask's key range.
inline const int64_t* key_range(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
  return p.key_ranges + b * p.key_range_strides[0] + h * p.key_range_strides[1] + i * p.key_range_strides[2];
}
inline int64_t window_first(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
  const int64_t band = p.window_left < 0 ? INT64_MIN / 2 : i + p.window_offset - p.window_left;
  return p.key_ranges ? std::max(band, key_range(p, b, h, i)[0]) : band;
}
inline int64_t window_last(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
  const int64_t band = p.window_right < 0 ? INT64_MAX / 2 : i + p.window_offset + p.window_right;
  return p.key_ranges ? std::min(band, key_range(p, b, h, i)[1] - 1) : band;
}

// The backward pass: reads the forward's inputs, its output and lse (fwd.out, fwd.lse) and dL/dout; writes
// dL/dq, dL/dk, dL/dv (dk and dv have the kv heads' shape: the query heads of a group are summed).
// The backward's algorithm (heuristics.h decides, from the shape): two passes (flash_backward.cpp: dK, dV per key
// tile, then dQ per query tile) or one (flash_backward_onepass.cpp: a task per (batch, kv head)). Both take every
// call the forward takes (masks, windows, dropout).
enum class BackwardPath { two_pass, one_pass };

struct AttentionBackwardParams {
  AttentionParams fwd;  // q, k, v, out, lse (all read), sizes, scale, mask, tiles, threads
  BackwardPath path = BackwardPath::two_pass;
  // one_pass: each (batch, kv head) is split into this many runs of key tiles, tasks of their own whose partial dQ
  // are summed in order afterwards (heuristics.h asks for more than one when there are too few kv heads for the CPUs).
  int64_t key_chunks = 1;
  // one_pass, float32: each (batch, kv head, run) is split further into this many parts of its query heads (a
  // divisor of the group size; heuristics.h asks for more than one for MQA-like groups on few kv heads).
  int64_t head_parts = 1;
  const void* dout = nullptr;  // (batch, num_heads, q_len, head_dim)
  void* dq = nullptr;          // like q
  void* dk = nullptr;          // like k
  void* dv = nullptr;          // like v
  int64_t dout_strides[3] = {0, 0, 0};
  int64_t dq_strides[3] = {0, 0, 0};
  int64_t dk_strides[3] = {0, 0, 0};
  int64_t dv_strides[3] = {0, 0, 0};
  // CUDA, deterministic (torch.use_deterministic_algorithms): zeroed counters, (batch, query head, row, 2), through
  // which the key tiles add each query tile's dQ blocks in key order, a tile's on the counter of its first row (and
  // consumer warpgroup: Hopper's bulk-reduction dQ path, kDqTma, the shipped traits'); null: in any order. Packed
  // sequences: one batch of the packed rows.
  int* dq_tickets = nullptr;
  int64_t dq_ticket_rows = 0;  // q_len, or the packed rows (total_q), + 64
};

// The backward's view of sequence b (sequence_view): dout and dq moved to its first query row, dk and dv to its first key.
CS149GPT_HOST_DEVICE inline AttentionBackwardParams sequence_view(const AttentionBackwardParams& bp, int64_t b) {
  if (!bp.fwd.cu_seqlens_q) return bp;
  AttentionBackwardParams s = bp;
  s.fwd = sequence_view(bp.fwd, b);
  const int64_t q0 = bp.fwd.cu_seqlens_q[b], k0 = bp.fwd.cu_seqlens_k[b];
  const DType t = bp.fwd.dtype;
  s.dout = rows_on(bp.dout, t, q0, bp.dout_strides[2]);
  s.dq = rows_on(bp.dq, t, q0, bp.dq_strides[2]);
  s.dk = rows_on(bp.dk, t, k0, bp.dk_strides[2]);
  s.dv = rows_on(bp.dv, t, k0, bp.dv_strides[2]);
  s.dout_strides[0] = s.dq_strides[0] = s.dk_strides[0] = s.dv_strides[0] = 0;
  return s;
}

// Two partial attention results over disjoint sets of keys merged into one (ring attention's step, merge.cpp and
// cuda/merge.cu): for every row, with m = max(lse, lse_b) (0 where both are −inf),
//   out ← (e^(lse − m)·out + e^(lse_b − m)·out_b) / (e^(lse − m) + e^(lse_b − m)),   lse ← m + log(e^(lse − m) + e^(lse_b − m))
// A NaN in either lse makes the row NaN; a row that no key reached on either side (both −inf) gets 0 and stays −inf.
// out and lse float32, in place; out_b in `dtype`, lse_b float32; all (batch, heads, rows[, head_dim]) through strides,
// head_dim contiguous.
struct MergeParams {
  float* out = nullptr;
  float* lse = nullptr;
  const void* out_b = nullptr;
  const float* lse_b = nullptr;
  DType dtype = DType::f32;  // out_b's
  int64_t batch = 0, heads = 0, rows = 0, head_dim = 0;
  int64_t out_strides[3] = {0, 0, 0}, out_b_strides[3] = {0, 0, 0};  // [batch, head, row]
  int64_t lse_strides[3] = {0, 0, 0}, lse_b_strides[3] = {0, 0, 0};
  int num_threads = 1;
};

// Row i (of batch · heads · rows, row fastest) of a merge: its out, lse and out_b, and lse_b's value.
template <class T>
struct MergeRow {
  float* out;
  float* lse;
  const T* out_b;
  float lse_b;
};
template <class T>
CS149GPT_HOST_DEVICE inline MergeRow<T> merge_row(const MergeParams& mp, int64_t i) {
  const int64_t b = i / (mp.heads * mp.rows), h = i / mp.rows % mp.heads, r = i % mp.rows;
  return {mp.out + b * mp.out_strides[0] + h * mp.out_strides[1] + r * mp.out_strides[2],
          mp.lse + b * mp.lse_strides[0] + h * mp.lse_strides[1] + r * mp.lse_strides[2],
          static_cast<const T*>(mp.out_b) + b * mp.out_b_strides[0] + h * mp.out_b_strides[1] + r * mp.out_b_strides[2],
          mp.lse_b[b * mp.lse_b_strides[0] + h * mp.lse_b_strides[1] + r * mp.lse_b_strides[2]]};
}
// The weights of one row's two sides (out ← c_a·out + c_b·out_b) from their lse a and b; returns the merged lse.
CS149GPT_HOST_DEVICE inline float merge_weights(float a, float b, float* c_a, float* c_b) {
  float m = (a != a || b != b) ? NAN : (a > b ? a : b);  // a NaN on either side: the row NaN
  if (m == -INFINITY) m = 0.0f;                           // no key on either side: weights 0, lse −inf
  const float w_a = expf(a - m), w_b = expf(b - m), sum = w_a + w_b;
  const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;
  *c_a = w_a * inv;
  *c_b = w_b * inv;
  return m + logf(sum);
}

// One kernel: how much float32 workspace it needs, and the kernel itself. The caller (module.cpp)
// allocates the workspace through torch's allocator, so the profiler sees it and a failure is a Python
// exception; kernels allocate nothing.
struct Kernel {
  int64_t (*workspace_floats)(const AttentionParams&);
  void (*run)(const AttentionParams&, float* workspace);
};

struct BackwardKernel {
  int64_t (*workspace_floats)(const AttentionBackwardParams&);
  void (*run)(const AttentionBackwardParams&, float* workspace);
};

// The kernels of one instruction set. Each ISA's translation unit (csrc/isa/) compiles every kernel
// file once with that ISA's flags and fills one of these tables; dispatch.cpp picks the table at load.
struct KernelTable {
  const char* isa;  // "amx", "avx512_bf16", "avx512", "avx2", "scalar", "amx_emulated"
  Kernel naive, blocked, fused, flash;
  Kernel decode;  // flash-decoding over a KV cache (flash_decode.cpp): any q_len, paged or not, appends k_new/v_new;
                  // attention()'s calls that heuristics::decode_kernel_takes, attn_mask and window included
  BackwardKernel flash_backward;
  // FMA throughput probe: runs `iterations` rounds of independent vector FMAs on each of num_threads
  // threads and returns the floating-point operations done (time it to get the peak).
  double (*fma_probe)(int64_t iterations, int num_threads);
  // The same for the bf16 dot-product instructions (AMX tiles, vdpbf16ps); null where the ISA has none.
  double (*bf16_dot_probe)(int64_t iterations, int num_threads);
  // Reads n floats (sums them, returned) on num_threads threads: time it to get the read bandwidth.
  double (*read_probe)(const float* x, int64_t n, int num_threads);
  // The vectorised exp, 2^x and tanh (softcap's) the kernels use, over a row in place (exposed so tests can check them).
  void (*exp_row)(float* x, int64_t n);
  void (*exp2_row)(float* x, int64_t n);
  void (*tanh_row)(float* x, int64_t n);
  void (*merge_partial)(const MergeParams& mp);  // merge.cpp
};

// The readable flash forward (csrc/kernels/flash_teaching.cpp): float32, scalar, compiled once (no ISA dispatch).
int64_t flash_teaching_workspace_floats(const AttentionParams& p);
void flash_teaching_attention(const AttentionParams& p, float* workspace);

namespace amx { extern const KernelTable kernel_table; }          // AVX-512 + AMX-BF16 tiles for bf16
namespace amx_emulated {  // the same, tiles in software (tests only)
extern const KernelTable kernel_table;
bool restores_tile_config();  // DotScope puts back a thread's tile configuration (tests; kernels_amx_emulated.cpp)
}  // namespace amx_emulated
namespace avx512_bf16 { extern const KernelTable kernel_table; }  // AVX-512 + vdpbf16ps for bf16
namespace avx512 { extern const KernelTable kernel_table; }
namespace avx2 { extern const KernelTable kernel_table; }
namespace scalar { extern const KernelTable kernel_table; }

// The table in use: chosen from the CPU's features when the module loads, or forced with the
// environment variable CS149GPT_ISA=amx|avx512_bf16|avx512|avx2|scalar|amx_emulated. set_isa() switches it (tests
// use it); amx_emulated, the amx kernels with the tiles done in software, is only ever chosen that way.
const KernelTable& kernels();
bool cpu_supports(const char* isa);
// Why AMX is not used although the CPU has it (the kernel refused the tile-data permission), or "".
const char* amx_unavailable_reason();
void set_isa(const char* isa);  // throws std::invalid_argument if unknown or unsupported

}  // namespace cs149gpt
