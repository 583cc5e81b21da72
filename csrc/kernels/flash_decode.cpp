// Flash-decoding: a few query rows (the tokens being generated) against a long key/value cache.
//
// Decoding is bound by memory: every step reads the whole cache once, and the arithmetic per key is small. So
// the kernel is arranged to read each cached key and value exactly once per call:
// - one task holds every query row of a GQA group — the G = Hq / Hkv query heads that share a kv head, times the
//   q_len rows of a short chunk — and reads each K/V block once for all of them (rows ρ = i·G + g, so rows of one
//   position are adjacent and visibility grows with ρ);
// - the keys are split instead of the queries: split s of S covers keys [s·Ls, (s+1)·Ls), and tasks are
//   (batch, kv head, split): S is the fewest splits of at least kMinSplitKeys keys that make kMinTasks tasks, enough
//   to fill any thread count up to that (a batch of many sequences needs no split at all). S depends on the shape
//   only, never on the thread count, and the splits are merged in a fixed order, so results are bitwise the same for
//   any number of threads.
// Split s computes for its keys, row by row, with the online softmax over blocks of keys (flash_common.h):
//   m_s = max_j s_j,   l_s = Σ_j exp(s_j − m_s),   O_s = Σ_j exp(s_j − m_s) v_j        (s_j = scale · q·k_j)
// and the merge combines the splits exactly, as the online softmax does blocks:
//   M = max_s m_s,   l = Σ_s exp(m_s − M) l_s,   O = Σ_s exp(m_s − M) O_s / l,   lse = M + log l.
// K and V are read in place, in their own dtype (decode_micro.h converts in registers, each key once for all the
// rows of a task): no packing, no conversion pass. While a block of keys is worked on, the next one is prefetched
// into L2, so that reading the cache overlaps the arithmetic instead of alternating with it. Small calls run on the
// calling thread, with no parallel region at all. The workspace (the splits' partials, per-thread scratch) comes
// from the caller.
//
// The same kernel serves attention_with_kvcache: sequences of their own lengths (cache_seqlens), starting at their own
// row (cache_leftpad), in cache rows of their own (cache_batch_idx) or a paged cache (block_table), new keys/values of
// any count appended to the cache before attending, and a sliding window aligned to each sequence's end (attention.h).
// Every one of these is an address (cache_row): the cache is read in place, never gathered.
// Non-finite values follow the README's rule: a NaN or +inf logit makes its row NaN, −inf logits weigh 0, and a
// key the causal mask hides from a row is never read for it (neither its k nor its v).
//
// attn_mask and the sliding window (attention()'s decoding calls; a KV cache call has the window alone) are looked at block
// by block of keys, row by row, as flash_common.h's mask_block classifies a tile:
//   hidden for every row:   the block is skipped, its keys and values never read;
//   visible for every row:  the unmasked path above, the mask read (a first look) and nothing else;
//   otherwise:              S_r = scale · q_r·K + bias_r on the rows the mask cuts (bias: 0, −inf or the additive
//                           value), −inf on the rows it hides; the block's keys stop at the last one any row sees.
// A key-padding mask ((B,1,1,K), or (B,1,Nq,K)) is hidden or visible on every block but the one or two its padding
// ends in, and the rows of a GQA group (one mask row) are looked at once. As with the causal mask, a key the mask
// hides from a row never touches it: P V runs over the keys the row sees (masked_block).
#include "../attention.h"
#include "decode_micro.h"
#include "flash_common.h"

#include <algorithm>
#include <omp.h>

namespace cs149gpt {
namespace CS149_ISA {
namespace flash_decode {

using flash::online_softmax;
using flash::round_up;

constexpr int64_t kMaxRows = heuristics::kDecodeMaxRows;  // attention() hands calls of up to this many rows here
constexpr int64_t kBlockKeys = 64;    // keys per online-softmax step: K and V blocks stay in L1/L2
constexpr int64_t kMaxTaskRows = 64;  // query rows per task: more (MQA with long chunks) are cut into tasks
// Splits: enough tasks for up to kMinTasks threads, none shorter than kMinSplitKeys keys; a whole number of key blocks
// each (heuristics.h).
constexpr int64_t kMinTasks = heuristics::kDecodeMinTasks;
constexpr int64_t kMinSplitKeys = heuristics::kDecodeMinSplitKeys;
// Below kSerialBytes of K and V read (all tasks together), and kParallelMacs multiply-adds (bytes alone undercount
// GQA, whose keys each serve G query heads, and bf16, half the bytes for the same arithmetic), the call runs on the
// calling thread, with no parallel region at all (heuristics.h); from there on, on all the caller's threads, never a
// team of another size: libgomp then rebuilds its pool (pytorch#32008), and asking for 8 of 16 threads made a GPT's
// matrix products around our call 9× slower.
constexpr int64_t kSerialBytes = heuristics::kDecodeSerialBytes;
constexpr int64_t kParallelMacs = heuristics::kDecodeParallelMacs;

// The flash kernel (flash.cpp) hands a call of decode_kernel_takes's shape to this path when it has no attn_mask and
// no window (module.cpp sends every call of that shape to the kernel table's `decode` directly, masked ones, softcap and
// ALiBi too).
inline bool applies(const AttentionParams& p) {
  return heuristics::decode_kernel_takes(p) && !has_mask_or_window(p);
}

inline int64_t pad16(int64_t n) { return round_up(n, 16); }

struct Layout {
  int64_t group;       // G: query heads per kv head
  int64_t rows;        // G · q_len rows per (batch, kv head)
  int64_t task_rows;   // rows per task (≤ kMaxTaskRows)
  int64_t row_tasks;   // tasks per (batch, kv head, split) along the rows
  int64_t split_len, splits;
  int64_t d_pad, d_pair;  // head_dim to whole vectors (16 floats); to whole bf16 dot steps (32)
  int64_t d_row;          // Q and O rows in the micro-kernels' chunk order (decode_micro.h): whole chunks
  int64_t part_row;       // O_s, then m_s and l_s
  int64_t parts_size;
  int64_t q_off, qb_off, s_off, o_off, m_off, l_off, alpha_off, mnew_off, bias_off, per_thread;  // per thread
  explicit Layout(const AttentionParams& p) {
    group = p.num_heads / p.num_kv_heads;
    rows = group * p.q_len;
    task_rows = std::min(rows, kMaxTaskRows);
    row_tasks = (rows + task_rows - 1) / task_rows;
    const int64_t groups = p.batch * p.num_kv_heads * row_tasks;
    const int64_t wanted = std::max<int64_t>(1, (kMinTasks + groups - 1) / groups);  // splits for kMinTasks tasks
    split_len = std::max(kMinSplitKeys, round_up((p.kv_len + wanted - 1) / wanted, kBlockKeys));
    splits = std::max<int64_t>(1, (p.kv_len + split_len - 1) / split_len);
    d_pad = pad16(p.head_dim);
    d_pair = round_up(p.head_dim, 32);
    d_row = round_up(p.head_dim, decode::kMaxChunkCols);
    part_row = d_pad + 2;
    parts_size = splits == 1 ? 0 : p.batch * p.num_kv_heads * splits * rows * part_row;
    q_off = 0;
    qb_off = q_off + task_rows * d_row;
    s_off = qb_off + pad16(task_rows * d_pair / 2);
    o_off = s_off + task_rows * kBlockKeys;
    m_off = o_off + task_rows * d_row;
    l_off = m_off + pad16(task_rows);
    alpha_off = l_off + pad16(task_rows);
    mnew_off = alpha_off + pad16(task_rows);
    bias_off = mnew_off + pad16(task_rows);  // attn_mask / window offsets of a block: a row per distinct mask row
    per_thread = bias_off + (has_mask_or_window(p) ? task_rows * kBlockKeys : 0);
  }
  int64_t tasks(const AttentionParams& p) const { return p.batch * p.num_kv_heads * splits * row_tasks; }
};

// Key t of kv head kvh of sequence b (its keys (or values) counted from cache_leftpad[b]), and how many rows from it
// on are contiguous (through the row stride): to the end of its page in a paged cache, else all of them. Sequence b's
// cache row is cache_batch_idx[b] when given (contiguous caches), its pages those of block_table's row b.
template <class T>
inline const T* cache_row(const AttentionParams& p, const void* base, const int64_t (&strides)[3], int64_t b,
                          int64_t kvh, int64_t t, int64_t* run) {
  if (p.cache_leftpad) t += p.cache_leftpad[b];
  if (!p.block_table) {
    *run = INT64_MAX;
    const int64_t row_of_b = p.cache_batch_idx ? p.cache_batch_idx[b] : b;
    return static_cast<const T*>(base) + row_of_b * strides[0] + kvh * strides[1] + t * strides[2];
  }
  const int64_t page = p.block_table[b * p.block_table_stride + t / p.page_size], row = t % p.page_size;
  *run = p.page_size - row;
  return static_cast<const T*>(base) + page * strides[0] + kvh * strides[1] + row * strides[2];
}

// The keys query row i of sequence b sees: [0, visible). Causal: bottom-right for a cache of per-sequence lengths
// (the last of the q_len queries sees the whole sequence), else as the call's causal_offset says.
inline int64_t visible_keys_of(const AttentionParams& p, int64_t kv_len, int64_t i) {
  if (!p.is_causal) return kv_len;
  const int64_t offset = p.cache_seqlens ? kv_len - p.q_len : p.causal_offset;
  return std::clamp<int64_t>(i + offset + 1, 0, kv_len);
}

// Appends k_new, v_new (batch, kv head b·Hkv + kvh) to the cache at keys [length − new_len, length).
template <class T>
void append_new_kv(const AttentionParams& p, int64_t b, int64_t kvh) {
  const int64_t first = seq_kv_len(p, b) - p.new_len;
  for (int64_t i = 0; i < p.new_len; ++i) {
    int64_t run;
    T* k = const_cast<T*>(cache_row<T>(p, p.k, p.k_strides, b, kvh, first + i, &run));
    T* v = const_cast<T*>(cache_row<T>(p, p.v, p.v_strides, b, kvh, first + i, &run));
    const T* kn = static_cast<const T*>(p.k_new) + b * p.k_new_strides[0] + kvh * p.k_new_strides[1] +
                  i * p.k_new_strides[2];
    const T* vn = static_cast<const T*>(p.v_new) + b * p.v_new_strides[0] + kvh * p.v_new_strides[1] +
                  i * p.v_new_strides[2];
    std::memcpy(k, kn, p.head_dim * sizeof(T));
    std::memcpy(v, vn, p.head_dim * sizeof(T));
  }
}

// Query row ρ = i·G + g of kv head kvh is row i of query head kvh·G + g.
inline int64_t head_of(const Layout& L, int64_t kvh, int64_t rho) { return kvh * L.group + rho % L.group; }

// The end of a row: out = O / l, lse = m + log l. l = 0: no key had any weight, out = 0 (or NaN where O is), lse =
// −inf. A NaN l stays NaN: never test `l > 0`.
template <class T>
inline void finish_row(const AttentionParams& p, int64_t b, int64_t h, int64_t i, const float* O, float m, float l) {
  T* out = out_head<T>(p, b, h) + i * p.out_strides[2];
  const float inv_l = l == 0.0f ? 0.0f : 1.0f / l;
  for (int64_t c = 0; c < p.head_dim; ++c) out[c] = static_cast<T>(O[c] * inv_l);
  if (p.lse) p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i] = l == 0.0f ? kNegInf : m + std::log(l);
}

// S = Q K_blockᵀ: the task's rows against n keys of the block (rows × n, unscaled, kBlockKeys apart); K_next: the
// next block's keys, prefetched meanwhile (none by default).
template <class T>
void block_scores(const AttentionParams& p, const Layout& L, int64_t rows, int64_t n, const T* K, float* scratch,
                  const decode::NextBlock<T>& K_next = decode::NextBlock<T>()) {
  float* S = scratch + L.s_off;
#if defined(CS149_ISA_BF16_DOT)
  if constexpr (std::is_same_v<T, c10::BFloat16> && decode::kKeysByBf16Dot) {
    decode::row_key_dots_bf16(rows, n, p.head_dim, reinterpret_cast<const c10::BFloat16*>(scratch + L.qb_off),
                              L.d_pair, K, p.k_strides[2], S, kBlockKeys, K_next);
    return;
  }
#endif
  decode::row_key_dots(rows, n, p.head_dim, scratch + L.q_off, L.d_row, K, p.k_strides[2], S, kBlockKeys, K_next);
}

// S = scale · S on the keys each row of the task sees (keys[r] of row r), with softcap and ALiBi where the call has
// them (flash_common.h's LogitMods; ALiBi's distance i + kv_len − q_len − j with p a sequence's view: its own length).
inline void scale_scores(const AttentionParams& p, const Layout& L, int64_t b, int64_t kvh, int64_t rho0, int64_t rows,
                         int64_t t0, const int64_t* keys, float* S) {
  const flash::LogitMods mods(p, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t rho = rho0 + r;
    if (mods.any)
      mods.row(p, b, head_of(L, kvh, rho), rho / L.group, t0, S + r * kBlockKeys, keys[r], p.scale);
    else
      scale_row(p.scale, S + r * kBlockKeys, keys[r]);
  }
}

// One block of n keys from t0 that no attn_mask or window cuts: the causal mask alone.
template <class T>
void plain_block(const AttentionParams& p, const Layout& L, int64_t b, int64_t kvh, int64_t rho0, int64_t rows,
                 int64_t kv_len, int64_t t0, int64_t n, const T* K, const T* V, const decode::NextBlock<T>& K_next,
                 const decode::NextBlock<T>& V_next, float* scratch) {
  const int64_t d = p.head_dim;
  float *S = scratch + L.s_off, *O = scratch + L.o_off;
  float *m = scratch + L.m_off, *l = scratch + L.l_off, *alpha = scratch + L.alpha_off, *m_new = scratch + L.mnew_off;
  int64_t visible[kMaxTaskRows];  // keys of the block each row sees
  block_scores<T>(p, L, rows, n, K, scratch, K_next);

  // S = scale · S (softcap, ALiBi), rounded before the max is taken, so that the largest logit's weight is exp(0) = 1
  // exactly (a single visible key returns its value row bitwise). Then the online softmax over the block:
  // S becomes P; m, l, α updated (flash_common.h).
  for (int64_t r = 0; r < rows; ++r)
    visible[r] = std::clamp<int64_t>(visible_keys_of(p, kv_len, (rho0 + r) / L.group) - t0, 0, n);
  scale_scores(p, L, b, kvh, rho0, rows, t0, visible, S);
  online_softmax(S, kBlockKeys, rows, n, visible, /*scale=*/1.0f, m, l, alpha, m_new);

  // O = α · O + P V_block. Keys every row sees go through the block kernel; the few that only later rows
  // see (the causal diagonal of a chunk) are added row by row, so a hidden key's value never touches a row.
  const int64_t shared = visible[0];
  decode::rows_times_values(rows, shared, S, kBlockKeys, V, p.v_strides[2], d, O, L.d_row, alpha, V_next);
  for (int64_t r = 1; r < rows; ++r)
    if (visible[r] > shared)
      decode::rows_times_values(1, visible[r] - shared, S + r * kBlockKeys + shared, kBlockKeys,
                                V + shared * p.v_strides[2], p.v_strides[2], d, O + r * L.d_row, L.d_row, nullptr);
}


// Beyond this many runs of shown keys in a row's block (a scattered mask), its P V is one block product over all
// its keys when the block's values are all finite (0 · v adds nothing), instead of a product per run.
constexpr int64_t kMaxRuns = 4;

// One block that attn_mask or the window cuts (mask_rows: row r sees keys among its first keys[r], through its
// offsets bias[r] where it has them); n: the keys past which no row sees any, the only ones read.
//   S_r = c(scale · q_r·K) + bias_r,  −inf past keys[r];  then the online softmax;  O_r = α_r · O_r + P_r V
// (c: softcap and ALiBi, scale_scores).
// P V goes over the keys a row sees only, so that a hidden key's value (NaN or inf in padding) never reaches it:
// rows that see the same keys (one bias row and prefix: the heads of a GQA group under a padding mask) together,
// run of consecutive shown keys by run (a padding mask's edge: one run). A scattered mask's many runs take one block
// product instead where the block's values are all finite (P is 0 at every hidden key).
template <class T>
void masked_block(const AttentionParams& p, const Layout& L, int64_t b, int64_t kvh, int64_t rho0, int64_t rows,
                  int64_t t0, int64_t n, const T* K, const T* V, int64_t* keys, const float* const* bias,
                  float* scratch) {
  const int64_t d = p.head_dim, ldv = p.v_strides[2];
  float *S = scratch + L.s_off, *O = scratch + L.o_off;
  float *m = scratch + L.m_off, *l = scratch + L.l_off, *alpha = scratch + L.alpha_off, *m_new = scratch + L.mnew_off;
  block_scores<T>(p, L, rows, n, K, scratch);
  scale_scores(p, L, b, kvh, rho0, rows, t0, keys, S);
  for (int64_t r = 0; r < rows; ++r)
    if (bias[r]) flash::add_mask(S + r * kBlockKeys, bias[r], keys[r]);
  online_softmax(S, kBlockKeys, rows, n, keys, /*scale=*/1.0f, m, l, alpha, m_new);

  int finite = -1;  // the block's values: unknown until a scattered row asks
  for (int64_t r0 = 0; r0 < rows;) {
    const float* shown = bias[r0];
    const int64_t end = keys[r0];
    int64_t r1 = r0 + 1;
    while (r1 < rows && bias[r1] == shown && keys[r1] == end) ++r1;
    const auto hidden = [&](int64_t t) { return shown && shown[t] == kNegInf; };
    int64_t runs = 0;
    for (int64_t t = 0; t < end; ++t) runs += !hidden(t) && (t == 0 || hidden(t - 1));
    float* P = S + r0 * kBlockKeys;
    if (runs > kMaxRuns && (finite < 0 ? (finite = flash::rows_finite(V, ldv, n, d)) : finite)) {
      decode::rows_times_values(r1 - r0, end, P, kBlockKeys, V, ldv, d, O + r0 * L.d_row, L.d_row, alpha + r0);
    } else {
      const float* run_alpha = alpha + r0;  // applied with the first run (alone when the rows see no key here)
      for (int64_t t = 0; t < end;) {
        if (hidden(t)) {
          ++t;
          continue;
        }
        int64_t e = t + 1;
        while (e < end && !hidden(e)) ++e;
        decode::rows_times_values(r1 - r0, e - t, P + t, kBlockKeys, V + t * ldv, ldv, d, O + r0 * L.d_row, L.d_row,
                                  run_alpha);
        run_alpha = nullptr;
        t = e;
      }
      if (run_alpha)
        decode::rows_times_values(r1 - r0, 0, P, kBlockKeys, V, ldv, d, O + r0 * L.d_row, L.d_row, run_alpha);
    }
    r0 = r1;
  }
}

// attn_mask and the window over keys [t0, t0 + n) for rows [ρ0, ρ0 + rows) of kv head kvh in sequence b. Row r:
//   hidden   (mask_block: no key it shows is shown by them):  keys[r] = 0;
//   visible  (they hide none of its keys and add nothing):    keys[r] = its causal prefix, bias[r] = null;
//   partial:  bias[r] = its offsets (0, −inf or the additive value; −inf past the causal prefix), keys[r] = the
//             keys up to the last one it sees.
// Rows that read one mask row over the same shown keys (the G heads of a group under a mask broadcast over heads;
// every row of a key-padding mask that is broadcast over the queries too) share one look and one bias row.
// Returns visible when every row is (the unmasked path, keys[] untouched), hidden when none sees any key, else
// partial, with *keys_end the keys past which no row sees any.
inline flash::MaskBlock mask_rows(const AttentionParams& p, const Layout& L, int64_t b, int64_t kvh, int64_t rho0,
                                  int64_t rows, int64_t t0, int64_t n, float* bias_rows, int64_t* keys,
                                  const float** bias, int64_t* keys_end) {
  using flash::MaskBlock;
  bool all_visible = true;
  int64_t end = 0, used = 0;
  // The previous look: its mask row, its causal prefix and the keys the causal mask and the window show it. A row
  // shares it only where all three agree: `visible` means "hides nothing the causal mask shows", so a row whose
  // causal prefix is longer (a later query of a key-padding mask) needs a look of its own even where the window
  // leaves it the same shown keys.
  int64_t last_at = -1, last_causal = -1, last_lo = -1, last_hi = -1;
  MaskBlock last = MaskBlock::visible;
  int64_t last_keys = 0;
  const float* last_bias = nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t rho = rho0 + r, i = rho / L.group, h = head_of(L, kvh, rho);
    const int64_t causal = std::clamp<int64_t>(visible_keys(p, i) - t0, 0, n);  // the keys the causal mask shows
    int64_t lo, hi;  // the keys of the block that the causal mask and the window show row i
    flash::shown_keys(p, b, h, i, t0, n, &lo, &hi);
    const int64_t at = p.mask ? b * p.mask_strides[0] + h * p.mask_strides[1] + i * p.mask_strides[2] : 0;
    if (r == 0 || at != last_at || causal != last_causal || lo != last_lo || hi != last_hi) {
      float* row_bias = bias_rows + used * kBlockKeys;
      last = flash::mask_block(p, b, h, i, 1, t0, n, row_bias, kBlockKeys, 1);
      last_at = at, last_causal = causal, last_lo = lo, last_hi = hi;
      last_bias = nullptr;
      if (last == MaskBlock::hidden) {
        last_keys = 0;
      } else if (last == MaskBlock::visible) {
        last_keys = causal;
      } else {
        last_bias = row_bias;
        last_keys = flash::shown_keys_end(row_bias, kBlockKeys, 1, n);
        ++used;
      }
    }
    all_visible &= last == MaskBlock::visible;
    keys[r] = last_keys;
    bias[r] = last_bias;
    end = std::max(end, last_keys);
  }
  *keys_end = end;
  return all_visible ? MaskBlock::visible : end == 0 ? MaskBlock::hidden : MaskBlock::partial;
}

// The call as sequence b of a KV cache sees it (kv_len its keys, the causal mask and window at its end), for the rules
// of attn_mask and the window (visible_keys, window_first/last), which read the call's lengths.
inline const AttentionParams& sequence_of_cache(const AttentionParams& p, int64_t kv_len, AttentionParams* view) {
  *view = p;
  view->kv_len = kv_len;
  view->causal_offset = view->window_offset = kv_len - p.q_len;
  return *view;
}

// One task: rows [ρ0, ρ0 + rows) of kv head kvh in sequence b against the keys of split s. Writes the rows'
// partials (O_s, m_s, l_s), or, when there is one split, the rows' output.
template <class T>
void split_task(const AttentionParams& p, const Layout& L, int64_t b, int64_t kvh, int64_t s, int64_t rho0,
                float* parts, float* scratch) {
  const int64_t d = p.head_dim, rows = std::min(L.task_rows, L.rows - rho0);
  const int64_t kv_len = seq_kv_len(p, b);
  const int64_t j0 = s * L.split_len, j1 = std::min(kv_len, j0 + L.split_len);
  float *Q = scratch + L.q_off, *O = scratch + L.o_off, *m = scratch + L.m_off, *l = scratch + L.l_off;
  int64_t keys[kMaxTaskRows];       // a masked block: the keys each row sees a prefix of (mask_rows)
  const float* bias[kMaxTaskRows];  // and the row's attn_mask / window offsets (null: none)
  const bool masked = has_mask_or_window(p);
  // A KV cache's causal mask and window are aligned to each sequence's own end: the blocks read a view with its length.
  AttentionParams seq_view;
  const AttentionParams& ps = p.cache_seqlens ? sequence_of_cache(p, kv_len, &seq_view) : p;
  fill_row(kNegInf, m, rows);
  fill_row(0.0f, l, rows);
  fill_row(0.0f, O, rows * L.d_row);

  // The keys of this split the task's last row sees (the others see a prefix of them).
  const int64_t keys_end = std::min(j1, visible_keys_of(p, kv_len, (rho0 + rows - 1) / L.group));
  if (j0 < keys_end) {
    // Q: the rows as float32 in the micro-kernels' chunk order, zero past d (or as bf16 pairs for vdpbf16ps).
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t rho = rho0 + r;
      const T* q = q_head<T>(p, b, head_of(L, kvh, rho)) + (rho / L.group) * p.q_strides[2];
#if defined(CS149_ISA_BF16_DOT)
      if constexpr (std::is_same_v<T, c10::BFloat16> && decode::kKeysByBf16Dot) {
        auto* qb = reinterpret_cast<c10::BFloat16*>(scratch + L.qb_off) + r * L.d_pair;
        for (int64_t c = 0; c < L.d_pair; ++c) qb[c] = c < d ? q[c] : c10::BFloat16(0.0f);
        continue;
      }
#endif
      decode::to_chunk_order(q, d, Q + r * L.d_row, L.d_row);
    }
    int64_t k_run, v_run;
    const T* K = cache_row<T>(p, p.k, p.k_strides, b, kvh, j0, &k_run);
    const T* V = cache_row<T>(p, p.v, p.v_strides, b, kvh, j0, &v_run);
    for (int64_t t0 = j0; t0 < keys_end;) {
      const int64_t n = std::min({kBlockKeys, keys_end - t0, k_run, v_run});
      // The next block's rows, prefetched while this one is worked on.
      decode::NextBlock<T> K_next, V_next;
      if (t0 + n < keys_end) {
        K_next.rows = cache_row<T>(p, p.k, p.k_strides, b, kvh, t0 + n, &k_run);
        V_next.rows = cache_row<T>(p, p.v, p.v_strides, b, kvh, t0 + n, &v_run);
        K_next.ld = p.k_strides[2];
        V_next.ld = p.v_strides[2];
        K_next.n = V_next.n = std::min({kBlockKeys, keys_end - t0 - n, k_run, v_run});
      }
      if (masked) {
        int64_t shown_end;
        switch (mask_rows(ps, L, b, kvh, rho0, rows, t0, n, scratch + L.bias_off, keys, bias, &shown_end)) {
          case flash::MaskBlock::hidden: break;  // no row sees a key of it: never read
          case flash::MaskBlock::visible:
            plain_block<T>(ps, L, b, kvh, rho0, rows, kv_len, t0, n, K, V, K_next, V_next, scratch);
            break;
          case flash::MaskBlock::partial:
            masked_block<T>(ps, L, b, kvh, rho0, rows, t0, shown_end, K, V, keys, bias, scratch);
            break;
        }
      } else {
        plain_block<T>(ps, L, b, kvh, rho0, rows, kv_len, t0, n, K, V, K_next, V_next, scratch);
      }
      t0 += n;
      K = K_next.rows;
      V = V_next.rows;
    }
    for (int64_t r = 0; r < rows; ++r) decode::from_chunk_order<T>(O + r * L.d_row, L.d_row);
  }

  if (L.splits == 1) {
    for (int64_t r = 0; r < rows; ++r)
      finish_row<T>(p, b, head_of(L, kvh, rho0 + r), (rho0 + r) / L.group, O + r * L.d_row, m[r], l[r]);
    return;
  }
  float* part = parts + (((b * p.num_kv_heads + kvh) * L.splits + s) * L.rows + rho0) * L.part_row;
  for (int64_t r = 0; r < rows; ++r, part += L.part_row) {
    std::memcpy(part, O + r * L.d_row, L.d_pad * sizeof(float));
    part[L.d_pad] = m[r];
    part[L.d_pad + 1] = l[r];
  }
}

// Row ρ of kv head kvh in sequence b: merges the splits' partials, in split order, into out and lse.
template <class T>
void merge_row(const AttentionParams& p, const Layout& L, int64_t b, int64_t kvh, int64_t rho, const float* parts,
               float* O) {
  const int64_t d = p.head_dim;
  const float* first = parts + ((b * p.num_kv_heads + kvh) * L.splits * L.rows + rho) * L.part_row;
  const int64_t split_stride = L.rows * L.part_row;
  float M = kNegInf;
  for (int64_t s = 0; s < L.splits; ++s) M = max_nan(M, first[s * split_stride + L.d_pad]);
  float l = 0.0f;
  fill_row(0.0f, O, d);
  for (int64_t s = 0; s < L.splits; ++s) {
    const float* part = first + s * split_stride;
    // 0 for a split with no weight (m_s = −inf); all 0 when no split has any (M = −inf, where exp(−inf + inf)
    // would be NaN); NaN when M is.
    const float w = M == kNegInf ? 0.0f : std::exp(part[L.d_pad] - M);
    l += w * part[L.d_pad + 1];
    axpy(w, part, O, d);  // even with w = 0: a NaN in O_s (from a NaN value row) must show
  }
  finish_row<T>(p, b, head_of(L, kvh, rho), rho / L.group, O, M, l);
}

// The three phases over their index ranges: appending, the split tasks, the merge.
template <class T>
void append_range(const AttentionParams& p, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) append_new_kv<T>(p, t / p.num_kv_heads, t % p.num_kv_heads);
}
template <class T>
void task(const AttentionParams& p, const Layout& L, int64_t t, float* parts, float* scratch) {
  const int64_t rt = t % L.row_tasks, s = (t / L.row_tasks) % L.splits;
  const int64_t kvh = (t / (L.row_tasks * L.splits)) % p.num_kv_heads;
  const int64_t b = t / (L.row_tasks * L.splits * p.num_kv_heads);
  split_task<T>(p, L, b, kvh, s, rt * L.task_rows, parts, scratch);
}
template <class T>
void merge(const AttentionParams& p, const Layout& L, int64_t r, const float* parts, float* scratch) {
  const int64_t rho = r % L.rows, kvh = (r / L.rows) % p.num_kv_heads, b = r / (L.rows * p.num_kv_heads);
  merge_row<T>(p, L, b, kvh, rho, parts, scratch);
}

template <class T>
void run(const AttentionParams& p, float* workspace) {
  const Layout L(p);
  float* parts = workspace;
  float* thread_scratch = workspace + L.parts_size;
  const int64_t n_heads = p.batch * p.num_kv_heads, n_tasks = L.tasks(p);
  const int64_t n_rows = L.splits == 1 ? 0 : n_heads * L.rows;
  const int64_t bytes = 2 * n_heads * p.kv_len * p.head_dim * static_cast<int64_t>(sizeof(T)) * L.row_tasks;
  const int64_t macs = 2 * p.batch * p.num_heads * p.q_len * p.kv_len * p.head_dim;  // q·k and p·v
  // Appending copies q_len rows per kv head (a few KB): on the calling thread, before any task reads the cache,
  // where a parallel loop would cost a barrier more than the copy.
  if (p.k_new) append_range<T>(p, 0, n_heads);
  if (p.num_threads == 1 || (bytes < kSerialBytes && macs < kParallelMacs) || n_tasks == 1) {  // the same work, in the same order
    for (int64_t t = 0; t < n_tasks; ++t) task<T>(p, L, t, parts, thread_scratch);
    for (int64_t r = 0; r < n_rows; ++r) merge<T>(p, L, r, parts, thread_scratch);
    return;
  }
#pragma omp parallel num_threads(p.num_threads)
  {
    float* scratch = thread_scratch + omp_get_thread_num() * L.per_thread;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tasks; ++t) task<T>(p, L, t, parts, scratch);
    if (n_rows > 0) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < n_rows; ++r) merge<T>(p, L, r, parts, scratch);
    }
  }
}

inline int64_t workspace_floats(const AttentionParams& p) {
  const Layout L(p);
  return L.parts_size + p.num_threads * L.per_thread;
}

}  // namespace flash_decode

// The kernel table's entry for attention_with_kvcache (any q_len).
inline int64_t flash_decode_workspace_floats(const AttentionParams& p) { return flash_decode::workspace_floats(p); }

inline void flash_decode_attention(const AttentionParams& p, float* workspace) {
  switch (p.dtype) {
    case DType::f32: flash_decode::run<float>(p, workspace); break;
    case DType::bf16: flash_decode::run<c10::BFloat16>(p, workspace); break;
    case DType::f16: flash_decode::run<c10::Half>(p, workspace); break;
  }
}

}  // namespace CS149_ISA
}  // namespace cs149gpt
