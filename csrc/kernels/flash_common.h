// What the flash forward (flash.cpp) and backward (flash_backward.cpp) share: the register blocking of
// their matrix products, and the loop that tiles a product of row groups into micro_gemm calls.
// Compiled once per ISA, like everything under kernels/ (see simd.h).
#pragma once

#include "../attention.h"
#include "../heuristics.h"
#include "simd.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <thread>
#include <type_traits>

#include <omp.h>

namespace cs149gpt {
namespace CS149_ISA {
namespace flash {

// Register blocking per ISA: kAccumulators vector registers hold the C block of micro_gemm, NV ≤ 3 or 4
// vectors wide and kAccumulators / NV rows tall; every such row count divides kRowGroup, the number of
// query rows the kernels move through QKᵀ → softmax → PV together.
// kQkVecs and kPvVecs are the widths the two kinds of product use where the columns allow: S = Q Kᵀ has
// a short k loop (d), so it takes more rows per B vector; O += P V a long one (the keys).
#if defined(CS149_ISA_AVX512)
constexpr int kAccumulators = 24, kRowGroup = 24, kQkVecs = 2, kPvVecs = 4;
#else
constexpr int kAccumulators = 12, kRowGroup = 12, kQkVecs = 3, kPvVecs = 3;
#endif
constexpr int W = Vec::width;
// The backward kernels' key tiles hold whole row groups (they are the rows of dK, dV) and whole vectors (the
// columns of S): a multiple of lcm(kRowGroup, W).
constexpr int64_t kKeyAlign = kRowGroup / std::gcd(kRowGroup, W) * W;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The row stride of a scratch matrix whose rows are n elements of `bytes` each: one cache line (64 B) more. Rows a
// multiple of 1–4 KB apart fall into the same few of L1's 64 sets, and a 16-row tile load or store (AMX) or a
// micro-kernel's rows would then evict each other (2 KB apart: a 2 × 2 block of S tiles put 16 lines into 12-way
// sets, a measurable slowdown of the forward); one line more spreads consecutive rows over the sets.
inline int64_t line_past(int64_t n, int64_t bytes) { return n + 64 / bytes; }

template <class T>
inline float to_float(T x) { return static_cast<float>(x); }

// C[:rows, :n_cols] = α · C + A[:rows, :K] · B[:K, :n_cols]   (α = 0 when alpha is null)
// through micro_gemm blocks of kAccumulators / NV rows × NV vectors. rows is a multiple of kRowGroup;
// n_cols a whole number of vectors, taken kVecs at a time, then the remainder. A[r, k] is at
// A + r·a_row + k·a_col (a_row = 1 reads a transposed matrix).
// kRowsAdjacent: A's rows are adjacent (a_row = 1, known when compiling: micro_gemm's kRowsAdjacent).
template <int NV, bool kRowsAdjacent = false>
void gemm_block(int64_t rows, int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb,
                float* C, int64_t ldc, const float* alpha, float* row_max = nullptr, int max_vecs = 0) {
  constexpr int R = kAccumulators / NV;
  for (int64_t r = 0; r < rows; r += R)
    micro_gemm<R, NV, kRowsAdjacent>(K, A + r * a_row, a_row, a_col, B, ldb, C + r * ldc, ldc,
                                     alpha ? alpha + r : nullptr, row_max ? row_max + r * W : nullptr, max_vecs);
}
template <int kVecs, bool kRowsAdjacent = false>
void group_gemm(int64_t rows, int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb,
                int64_t n_cols, float* C, int64_t ldc, const float* alpha) {
  constexpr int64_t chunk = kVecs * W;
  int64_t c = 0;
  for (; c + chunk <= n_cols; c += chunk)
    gemm_block<kVecs, kRowsAdjacent>(rows, K, A, a_row, a_col, B + c, ldb, C + c, ldc, alpha);
  switch ((n_cols - c) / W) {
    case 0: break;
    case 1: gemm_block<1, kRowsAdjacent>(rows, K, A, a_row, a_col, B + c, ldb, C + c, ldc, alpha); break;
    case 2: gemm_block<2, kRowsAdjacent>(rows, K, A, a_row, a_col, B + c, ldb, C + c, ldc, alpha); break;
    case 3: gemm_block<3, kRowsAdjacent>(rows, K, A, a_row, a_col, B + c, ldb, C + c, ldc, alpha); break;
  }
}

// The same product with B in panels (flash.cpp's packed K_jᵀ): B's columns [c, c + panel) form a contiguous
// K × panel block at B + (c / panel) · panel · K, its rows panel floats apart. panel is kVecs vectors (every
// block of columns then lies in one panel), or all of n_cols if that is less.
// row_max (optional, rows × W floats): each row's running maximum (micro_gemm's) over its first max_cols columns,
// in whole vectors: the columns from max_cols / W · W on are left to the caller.
template <int kVecs, bool kRowsAdjacent = false>
void group_gemm_panels(int64_t rows, int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B,
                       int64_t panel, int64_t n_cols, float* C, int64_t ldc, float* row_max = nullptr,
                       int64_t max_cols = 0) {
  constexpr int64_t chunk = kVecs * W;
  const auto panel_of = [&](int64_t c) { return B + c / panel * panel * K + c % panel; };
  const auto vecs_of = [&](int64_t c) { return static_cast<int>(std::clamp<int64_t>((max_cols - c) / W, 0, kVecs)); };
  int64_t c = 0;
  for (; c + chunk <= n_cols; c += chunk)
    gemm_block<kVecs, kRowsAdjacent>(rows, K, A, a_row, a_col, panel_of(c), panel, C + c, ldc, nullptr, row_max,
                                     vecs_of(c));
  const auto tail = [&](auto nv) {
    gemm_block<decltype(nv)::value, kRowsAdjacent>(rows, K, A, a_row, a_col, panel_of(c), panel, C + c, ldc, nullptr,
                                                   row_max, vecs_of(c));
  };
  switch ((n_cols - c) / W) {
    case 0: break;
    case 1: tail(std::integral_constant<int, 1>{}); break;
    case 2: tail(std::integral_constant<int, 2>{}); break;
    case 3: tail(std::integral_constant<int, 3>{}); break;
  }
}

// The max of a row of n scores s whose first n / W · W a running maximum row_max (one vector, micro_gemm's) has
// already taken with NaN lanes skipped: the vector's lanes and the tail. As max_of would give it, NaN included: a row
// with a NaN but no other score above −inf is NaN (read again, only then); elsewhere a skipped NaN still turns its
// row NaN, through P = 2^(NaN − m) in l and O.
inline float row_max_from_vecs(const float* row_max, const float* s, int64_t n) {
  float mx = reduce_max(Vec::load(row_max));
  for (int64_t t = n / W * W; t < n; ++t) mx = max_nan(mx, s[t]);
  if (mx == kNegInf)
    for (int64_t t = 0; t < n; ++t)
      if (s[t] != s[t]) return s[t];
  return mx;
}

// One step of the online softmax (the paper's lines 9–11) for a group of G query rows against one key tile
// of n_keys scores per row, S[r·ld + t]; row r sees the first visible[r] of them:
//   S = scale · S (scale ≠ 0), −inf past visible[r];   m_new = max(m, rowmax S);   α = exp(m − m_new);
//   S = P = exp(S − m_new);   l = α · l + rowsum P;   m = m_new.
// A row that sees no key yet (m_new = −inf) keeps P = 0, α = 1. The max keeps a NaN (max_nan, max_of):
// m_new = NaN makes α, P and l NaN, so a NaN logit turns the whole row NaN; so does +inf, through
// exp(inf − inf). alpha and m_new are G floats of scratch; alpha holds α afterwards. P goes where PWriter puts
// it (over S by default). row_max (optional, G × W floats): S's row maxima as micro_gemm took them (row_max_from_vecs),
// when every row sees all n_keys scores and nothing was added to S after its product.
// Where P = exp(S − m_new) goes: over S itself (the float32 kernels), or elsewhere (flash_bf16.cpp writes it in
// bf16 for the next product). exp_sum writes row r's P and returns its sum; zero writes a row of zeros.
// kBase2: the logits S (and so m) are in base 2, P = 2^(S − m_new) (flash.cpp folds log2 e into Q's scale).
// logit: softcap or ALiBi applied in the same pass (FusedLogit), so that S is read once, not three times (their
// pass, the max, the exp).
//
// What the exp pass applies to the scores besides the scale: nothing; softcap, P = exp(cap · tanh(scale · S / cap) − m)
// on the keys each row sees (their −inf past them would become −cap); or (flash.cpp, float32) ALiBi,
// −slope · |dist0[r] − t| at key t of the tile, row r's max then bounded from the scores' max and the largest
// offset on its keys (flash.cpp checks the bound is close enough; a row it is not for took ALiBi already and has
// dist0[r] = kAlibiApplied). LogitMods::fused_softcap / fused_alibi say when.
struct FusedLogit {
  static constexpr int32_t kAlibiApplied = INT32_MIN;
  float cap = 0.0f;
  float slope = 0.0f;              // ALiBi's slope in the logits' units
  const int32_t* dist0 = nullptr;  // per row, key 0's distance from the diagonal (ALiBi; null: none)
  const float* bound = nullptr;    // per row, the largest ALiBi offset on the keys it sees
  bool alibi(int64_t r) const { return dist0 && dist0[r] != kAlibiApplied; }
  // The row's largest logit from its largest score mx (tanh being increasing; with ALiBi an upper bound).
  float max_logit(int64_t r, float mx, int64_t visible) const {
    if (cap > 0.0f && visible > 0) return cap * std::tanh(mx / cap);
    return alibi(r) ? mx + bound[r] : mx;
  }
  int64_t keys(int64_t n_keys, int64_t visible) const { return cap > 0.0f ? visible : n_keys; }
};

struct PInPlace {
  static constexpr bool kBase2 = false;
  FusedLogit logit;  // none: its user (flash_decode.cpp) applies softcap and ALiBi in a pass of their own
  float exp_sum(int64_t, float* s, float shift, int64_t n, float scale) const {
    return exp_shifted_sum(s, shift, n, scale);
  }
  void zero(int64_t, float* s, int64_t n) const { fill_row(0.0f, s, n); }
};
struct PInPlaceBase2 {
  static constexpr bool kBase2 = true;
  FusedLogit logit;  // scale 1 with ALiBi
  float exp_sum(int64_t r, float* s, float shift, int64_t n, float scale) const {
    const float cap = logit.cap;
    if (cap > 0.0f) return exp2_sum_with(TanhLogit(scale / cap, cap, -shift), s, n);
    if (logit.alibi(r)) return exp2_sum_with(AlibiLogit(logit.slope, shift, logit.dist0[r]), s, n);
    return exp2_shifted_sum(s, shift, n, scale);
  }
  void zero(int64_t, float* s, int64_t n) const { fill_row(0.0f, s, n); }
};

template <class PWriter = PInPlace>
inline void online_softmax(float* S, int64_t ld, int64_t G, int64_t n_keys, const int64_t* visible, float scale,
                           float* m, float* l, float* alpha, float* m_new, const PWriter& P = PWriter(),
                           const float* row_max = nullptr) {
  // A positive scale rides along (max of scale·S = scale · max of S; the exp's argument is one FMA);
  // another is applied to S first.
  const bool scale_in_exp = scale > 0.0f;
  for (int64_t r = 0; r < G; ++r) {
    float* s = S + r * ld;
    if (!scale_in_exp) scale_row(scale, s, visible[r]);
    fill_row(kNegInf, s + visible[r], n_keys - visible[r]);
    const float mx = (scale_in_exp ? scale : 1.0f) *
                     (row_max ? row_max_from_vecs(row_max + r * W, s, n_keys) : max_of(s, n_keys));
    m_new[r] = max_nan(m[r], P.logit.max_logit(r, mx, visible[r]));
    alpha[r] = m_new[r] == kNegInf ? 0.0f : m[r] - m_new[r];  // exponent of α; −inf on a first tile
  }
  if constexpr (PWriter::kBase2)
    exp2_row(alpha, G);
  else
    exp_row(alpha, G);
  for (int64_t r = 0; r < G; ++r) {
    float* s = S + r * ld;
    if (m_new[r] == kNegInf) {
      P.zero(r, s, n_keys);
      continue;
    }
    l[r] = alpha[r] * l[r] + P.exp_sum(r, s, m_new[r], P.logit.keys(n_keys, visible[r]), scale_in_exp ? scale : 1.0f);
    m[r] = m_new[r];
  }
}

// attn_mask and the sliding window over a block: rows [i0, i0 + n_i) × keys [j0, j0 + n_j) of query head h in
// batch b. Every kernel reads them through mask_block (or, the forward where it can, classify_mask_block and
// add_mask_row below), once per block of the tiles it computes anyway: the block's
// entries as float offsets of the logits go to bias[r·ld_i + t·ld_j] — 0 where the key takes part, −inf where
// attn_mask, the window or the causal mask hides it, the additive value otherwise — and the block is classified:
//   hidden:  they hide every entry the causal mask shows (or the causal mask shows none): skip the block;
//   visible: they hide none and add nothing: the unmasked path, bias unused;
//   partial: S = S + bias (add_mask) before the softmax.
// A block outside the window's band is hidden and one inside it visible (without attn_mask) at a glance, unread.
// A NaN entry of attn_mask is neither 0 nor −inf: partial, and the row turns NaN, as in torch.
enum class MaskBlock { hidden, visible, partial };

// A boolean entry (a byte, 0 = hidden) as its offset: 0 or −inf, by integer arithmetic so that the loops over a
// mask row vectorise (m − 1 is all ones only for m = 0; masked to −inf's bits).
inline float mask_entry(uint8_t m) {
  const uint32_t bits = (uint32_t{m} - 1u) & 0xFF800000u;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
template <class M>
inline float mask_entry(M m) { return static_cast<float>(m); }

// The keys [lo, hi) of row i (query head h, batch b) within a block starting at key j0 of n_j keys that both the
// causal mask and the window show.
inline void shown_keys(const AttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n_j, int64_t* lo,
                       int64_t* hi) {
  const int64_t causal_keys = std::clamp<int64_t>(visible_keys(p, i) - j0, 0, n_j);
  *lo = std::clamp<int64_t>(window_first(p, b, h, i) - j0, 0, causal_keys);
  *hi = std::clamp<int64_t>(window_last(p, b, h, i) + 1 - j0, *lo, causal_keys);
}

// A first look at attn_mask over the block, before anything is converted: hidden, visible or partial as
// mask_block says, stopping at the first sign of `partial`. Most blocks of real masks (padding, causal, packed
// sequences) are hidden or visible whole, and then this is all that is read. Rows that read the same mask row
// over the same keys (a mask broadcast over the query rows) are looked at once.
template <class M>
MaskBlock classify_block(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t n_i, int64_t j0,
                         int64_t n_j) {
  const M* base = static_cast<const M*>(p.mask) + b * p.mask_strides[0] + h * p.mask_strides[1];
  const int64_t s_i = p.mask_strides[2], s_j = p.mask_strides[3];
  bool any_shown = false, all_plain = true;
  const M* last_row = nullptr;
  int64_t last_lo = -1, last_hi = -1;
  for (int64_t r = 0; r < n_i; ++r) {
    int64_t lo, hi;
    shown_keys(p, b, h, i0 + r, j0, n_j, &lo, &hi);
    const M* row = base + (i0 + r) * s_i + j0 * s_j;
    if (row == last_row && lo == last_lo && hi == last_hi) continue;
    last_row = row, last_lo = lo, last_hi = hi;
    int64_t t = lo;
    if constexpr (std::is_same_v<M, uint8_t>) {
      if (s_j == 1) {  // eight entries (bools: bytes 0 or 1) a word, in a loop the compiler vectorises
        uint64_t any = 0, not_all = 0;
        for (; t + 8 <= hi; t += 8) {
          uint64_t w;
          std::memcpy(&w, row + t, 8);
          any |= w;
          not_all |= w ^ 0x0101010101010101ull;
        }
        any_shown |= any != 0;
        all_plain &= not_all == 0;
      }
    }
    int any = 0, plain = 1;  // ints, not bools: reductions the compiler vectorises
    for (; t < hi; ++t) {
      const float x = mask_entry(row[t * s_j]);
      any |= x != kNegInf;
      plain &= x == 0.0f;
    }
    any_shown |= any != 0;
    all_plain &= plain != 0;
    if (any_shown && !all_plain) return MaskBlock::partial;
  }
  return !any_shown ? MaskBlock::hidden : all_plain ? MaskBlock::visible : MaskBlock::partial;
}

// M: attn_mask's element type (uint8_t for boolean masks); void: no attn_mask, the window alone.
template <class M>
MaskBlock mask_block_of(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t n_i, int64_t j0,
                        int64_t n_j, float* bias, int64_t ld_i, int64_t ld_j) {
  if constexpr (!std::is_void_v<M>) {
    const MaskBlock first_look = classify_block<M>(p, b, h, i0, n_i, j0, n_j);
    if (first_look == MaskBlock::hidden) return first_look;
    // attn_mask hides nothing here and adds nothing: visible, unless the window cuts the block.
    if (first_look == MaskBlock::visible && !has_window(p)) return first_look;
  }
  bool any_shown = false, all_plain = true;
  for (int64_t r = 0; r < n_i; ++r) {
    const int64_t i = i0 + r;
    const int64_t causal_keys = std::clamp<int64_t>(visible_keys(p, i) - j0, 0, n_j);  // the causal prefix
    int64_t lo, hi;  // the window within it: keys [lo, hi) of the block
    shown_keys(p, b, h, i, j0, n_j, &lo, &hi);
    all_plain &= lo == 0 && hi == causal_keys;
    float* out = bias + r * ld_i;
    for (int64_t t = 0; t < lo; ++t) out[t * ld_j] = kNegInf;
    if constexpr (std::is_void_v<M>) {
      any_shown |= hi > lo;
      for (int64_t t = lo; t < hi; ++t) out[t * ld_j] = 0.0f;
    } else {
      const M* row = static_cast<const M*>(p.mask) + b * p.mask_strides[0] + h * p.mask_strides[1] +
                     i * p.mask_strides[2] + j0 * p.mask_strides[3];
      const int64_t s_j = p.mask_strides[3];
      // One pass: convert, store, and note whether any entry shows its key and whether all add 0 — in ints, not
      // bools, so that the common layout's loop vectorises (bool |= / &= reductions do not).
      int any = 0, plain = 1;
      if (s_j == 1 && ld_j == 1) {
        for (int64_t t = lo; t < hi; ++t) {
          const float x = mask_entry(row[t]);
          out[t] = x;
          any |= x != kNegInf;
          plain &= x == 0.0f;
        }
      } else {
        for (int64_t t = lo; t < hi; ++t) {
          const float x = mask_entry(row[t * s_j]);
          out[t * ld_j] = x;
          any |= x != kNegInf;
          plain &= x == 0.0f;
        }
      }
      any_shown |= any != 0;
      all_plain &= plain != 0;
    }
    for (int64_t t = hi; t < n_j; ++t) out[t * ld_j] = kNegInf;
  }
  return !any_shown ? MaskBlock::hidden : all_plain ? MaskBlock::visible : MaskBlock::partial;
}

// With key ranges or a window, the keys of a block past the last one any of its rows shows are hidden from all of
// them: the block's key count n_j shrinks to that end before it is classified (and attn_mask, if any, is read only
// up to it). A padded batch ends every row of a sequence at the same key, so its blocks then come out whole (visible:
// the unmasked path, over fewer keys) rather than cut (partial: a bias row built and added for every row).
inline int64_t window_keys_end(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t n_i, int64_t j0,
                               int64_t n_j) {
  if (!has_window(p)) return n_j;
  int64_t last = -1;
  for (int64_t i = i0; i < i0 + n_i; ++i) last = std::max(last, window_last(p, b, h, i));
  return std::clamp<int64_t>(last - j0 + 1, 0, n_j);
}

// Asks for the attn_mask entries of a block the kernel will classify next (rows [i0, i0 + n_i), keys [j0, j0 + n_j)),
// so that reading them overlaps the current block's products. A mask row of N ≥ 1024 keys spans a 4 KB page (float32)
// or a quarter of one (bool): the block's rows are as many separate short runs, which the hardware prefetchers do not
// follow across pages. On a 2-core EPYC (f32, one thread, (4,12,1024,64) with a (1, H, N, N) float mask) the mask pass
// sat on these loads, ~20 % of the kernel; asking a block ahead made the call 3–4 % faster.
inline void prefetch_mask_block(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t n_i, int64_t j0,
                                int64_t n_j) {
  if (p.mask_kind == MaskKind::none || p.mask_strides[3] != 1 || n_j <= 0 || n_i <= 0) return;
  const int64_t size = p.mask_kind == MaskKind::boolean ? 1 : p.mask_dtype == DType::f32 ? 4 : 2;
  const char* base = static_cast<const char*>(p.mask) +
                     size * (b * p.mask_strides[0] + h * p.mask_strides[1] + j0 + i0 * p.mask_strides[2]);
  const int64_t bytes = n_j * size, row_bytes = p.mask_strides[2] * size;
  for (int64_t r = 0; r < n_i; ++r) {
    const char* row = base + r * row_bytes;
    if (r > 0 && row_bytes == 0) break;  // one row broadcast over the queries
    for (int64_t off = 0; off < bytes; off += 64) prefetch_line(row + off);
    prefetch_line(row + bytes - 1);
  }
}

// The block after (row group g0, key tile j0) in the forward kernels' order — the next row group of the same key
// tile, else the first row group of the next key tile — prefetched (query tile rows [i0, i0 + rows), groups of
// `group` rows, key tiles of Bc).
inline void prefetch_next_mask_block(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t rows,
                                     int64_t g0, int64_t group, int64_t j0, int64_t Bc) {
  if (p.mask_kind == MaskKind::none) return;
  const int64_t next_g0 = g0 + group < rows ? g0 + group : 0, next_j0 = next_g0 > 0 ? j0 : j0 + Bc;
  const int64_t next_rows = std::min(group, rows - next_g0);
  if (next_j0 >= p.kv_len) return;
  prefetch_mask_block(p, b, h, i0 + next_g0, next_rows, next_j0,
                      window_keys_end(p, b, h, i0 + next_g0, next_rows, next_j0, std::min(Bc, p.kv_len - next_j0)));
}

// f(M{}) with M attn_mask's entry type (uint8_t for a boolean mask).
template <class F>
inline auto with_mask_type(const AttentionParams& p, const F& f) {
  if (p.mask_kind == MaskKind::boolean) return f(uint8_t{});
  switch (p.mask_dtype) {
    case DType::bf16: return f(c10::BFloat16{});
    case DType::f16: return f(c10::Half{});
    default: return f(float{});
  }
}

inline MaskBlock mask_block(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t n_i, int64_t j0,
                            int64_t n_j, float* bias, int64_t ld_i, int64_t ld_j) {
  if (!has_mask_or_window(p)) return MaskBlock::visible;
  if (has_window(p)) {
    // The window of each row against the block's keys [j0, j1]: hidden if it meets no row's, visible (without
    // attn_mask) if it lies within every row's. (The sliding window's band moves right with i; attn_mask's key
    // ranges may go anywhere, so every row is asked: a few integers against the block's products.)
    const int64_t j1 = j0 + n_j - 1;
    bool none_meets = true, all_cover = true;
    for (int64_t i = i0; i < i0 + n_i; ++i) {
      const int64_t first = window_first(p, b, h, i), last = window_last(p, b, h, i);
      none_meets &= last < j0 || first > j1 || first > last;
      all_cover &= first <= j0 && last >= j1;
    }
    if (none_meets) return MaskBlock::hidden;
    if (p.mask_kind == MaskKind::none && all_cover) return MaskBlock::visible;
  }
  if (p.mask_kind == MaskKind::none) return mask_block_of<void>(p, b, h, i0, n_i, j0, n_j, bias, ld_i, ld_j);
  return with_mask_type(p, [&](auto entry) {
    return mask_block_of<decltype(entry)>(p, b, h, i0, n_i, j0, n_j, bias, ld_i, ld_j);
  });
}

// The keys of a partial block past the last one any of its rows shows need no scores: the block's key count
// shrinks to that end (a causal pattern passed as attn_mask then costs what is_causal costs).
// The offsets are float (mask_block's buffer), or attn_mask's own entries read in place (M: uint8_t for a boolean
// mask, float, bf16, f16; mask_entry converts): the forward's direct path below.
template <class M>
inline bool all_hidden16(const M* bias) {
  int all = 1;  // an int reduction: one vector compare
  for (int t = 0; t < 16; ++t) all &= mask_entry(bias[t]) == kNegInf;
  return all != 0;
}
template <class M>
inline int64_t shown_keys_end(const M* bias, int64_t ld, int64_t rows, int64_t n) {
  int64_t end = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const M* row = bias + r * ld;
    int64_t t = n;
    while (t - 16 >= end && all_hidden16(row + t - 16)) t -= 16;  // (a causal diagonal hides up to a whole tile)
    while (t > end && mask_entry(row[t - 1]) == kNegInf) --t;
    end = std::max(end, t);
  }
  return end;
}

// s[t] = scale · s[t] + unit · bias[t], and −inf wherever bias is: a hidden key's logit is dropped even when it is
// NaN. unit converts the mask's natural-log offsets to the logits' base (log2 e for flash.cpp's base-2 logits);
// scale lets a kernel whose logits are not yet scaled (flash_bf16.cpp) do both in this one pass.
template <class M>
inline void add_mask(float* s, const M* bias, int64_t n, float unit = 1.0f, float scale = 1.0f) {
  for (int64_t t = 0; t < n; ++t) {  // (vectorises)
    const float x = mask_entry(bias[t]);
    s[t] = x == kNegInf ? kNegInf : scale * s[t] + unit * x;
  }
}

// x[t] = 0 where attn_mask hides key t (bias −inf): the backward's dS there is 0 even where dP (0 · NaN) is NaN.
inline void zero_where_hidden(float* x, const float* bias, int64_t n) {
  for (int64_t t = 0; t < n; ++t) x[t] = bias[t] == kNegInf ? 0.0f : x[t];
}

// A block attn_mask cuts, the quick way (the forward kernels, flash.cpp and flash_bf16.cpp): when nothing but the
// causal mask hides keys besides attn_mask (no window) and a mask row's keys are adjacent, the block is only
// classified (classify_mask_block: its first look, hidden / visible / partial) and a cut block's rows are added to S
// straight from the mask (add_mask_row), with no offsets buffer written and read back in between. A T5-style
// (1, H, N, N) bias cuts every block: on a 16-core Xeon one thread's bf16 call spent 55 % more time with it than
// without, the buffer's round trip through L2 included.
// Key ranges beside attn_mask (mask_ranges.cpp: runs of keys that add a bias) take this path too: the mask itself is −inf
// outside each row's run, so its rows are added as they are, and the runs only keep the reading inside them
// (window_keys_end, classify_block's shown_keys). A sliding window is not in the mask: it takes mask_block.
inline bool mask_rows_direct(const AttentionParams& p) {
  return p.mask_kind != MaskKind::none && p.window_left < 0 && p.window_right < 0 && p.mask_strides[3] == 1;
}
inline MaskBlock classify_mask_block(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t n_i,
                                     int64_t j0, int64_t n_j) {
  if (p.mask_kind == MaskKind::none) return MaskBlock::visible;
  const MaskBlock block = with_mask_type(p, [&](auto entry) {
    return classify_block<decltype(entry)>(p, b, h, i0, n_i, j0, n_j);
  });
  // classify_block looks inside the runs only: where they add nothing the block is whole only if every row's run
  // covers all the keys the causal mask shows it; else the −inf outside the runs is added (partial).
  if (block == MaskBlock::visible && p.key_ranges != nullptr)
    for (int64_t i = i0; i < i0 + n_i; ++i) {
      int64_t lo, hi;
      shown_keys(p, b, h, i, j0, n_j, &lo, &hi);
      if (lo != 0 || hi != std::clamp<int64_t>(visible_keys(p, i) - j0, 0, n_j)) return MaskBlock::partial;
    }
  return block;
}
// shown_keys_end and add_mask on attn_mask's own rows (the direct path): the entries of rows [i0, i0 + n_i) (or row i)
// of query head h in batch b from key j0 on, in the mask's type.
template <class F>
inline auto with_mask_rows(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t j0, const F& f) {
  const int64_t at = b * p.mask_strides[0] + h * p.mask_strides[1] + i0 * p.mask_strides[2] + j0;
  return with_mask_type(p, [&](auto entry) { return f(static_cast<const decltype(entry)*>(p.mask) + at); });
}
// One past the last key any of the rows shows (a causal pattern passed as a bias then costs what is_causal costs here
// too).
inline int64_t shown_keys_end_direct(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t n_i,
                                     int64_t j0, int64_t n) {
  return with_mask_rows(p, b, h, i0, j0, [&](const auto* rows) { return shown_keys_end(rows, p.mask_strides[2], n_i, n); });
}

// s[t] = scale · s[t] + unit · (attn_mask's offset of row i, key j0 + t), −inf where it hides the key, for t < n.
inline void add_mask_row(const AttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j0, float* s, int64_t n,
                         float unit = 1.0f, float scale = 1.0f) {
  with_mask_rows(p, b, h, i, j0, [&](const auto* row) { add_mask(s, row, n, unit, scale); });
}

// softcap and ALiBi (attention.h), applied to the scores of a block as the product leaves them, before attn_mask:
//   s = scale · s;   s = cap · tanh(s / cap)  (softcap > 0);   s = s − unit · slope · |i + kv_len − q_len − j|  (ALiBi)
// in the logits' own units: `unit` is log2 e for flash.cpp's base-2 logits (cap · log2 e is then the cap: the same
// function of the natural-log logit). grad (optional): 1 − tanh², softcap's derivative, for the backward's dS.
// A line of scores is a row (query i, keys j0 + t) or, in the backward's transposed tiles, a column (queries i0 + t,
// key j); either way the ALiBi distance is linear in t. The whole is one vector pass (simd.h's tanh), nothing stored
// but the results; row_max (optional, one vector): the running maximum of the results, NaN lanes skipped, as
// micro_gemm's (row_max_from_vecs reads it), so that the softmax need not read the line again for its max.
// A +inf logit becomes +cap under softcap, NaN stays NaN.
template <bool kCap, bool kAlibi>
inline void logit_line(float* s, int64_t n, float scale, float cap, float slope, int32_t dist0, int step,
                       float* grad, float* row_max) {
  constexpr int W = Vec::width;
  alignas(64) static constexpr float kIota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const Vec to_x = Vec::broadcast(kCap ? scale / cap : scale), c = Vec::broadcast(cap), one = Vec::broadcast(1.0f);
  const Vec minus_slope = Vec::broadcast(-slope), dist_step = Vec::broadcast(static_cast<float>(step * W));
  // The distances of the vector's lanes, exact in float32 (|distance| < 2^24).
  Vec dist = fmadd(Vec::load(kIota), Vec::broadcast(static_cast<float>(step)), Vec::broadcast(static_cast<float>(dist0)));
  Vec mx = row_max ? Vec::load(row_max) : Vec::zero();
  const auto apply = [&](Vec x, float* g, int64_t lanes) {
    Vec v = x * to_x;
    if constexpr (kCap) {
      const Vec th = tanh(v);
      v = c * th;
      if (g) {
        const Vec dth = fmadd(th * Vec::broadcast(-1.0f), th, one);  // 1 − tanh²
        lanes == W ? dth.store(g) : dth.store_partial(g, lanes);
      }
    }
    if constexpr (kAlibi) v = fmadd(minus_slope, abs(dist), v);
    return v;
  };
  int64_t t = 0;
  for (; t + W <= n; t += W) {
    const Vec v = apply(Vec::load(s + t), grad ? grad + t : nullptr, W);
    v.store(s + t);
    if (row_max) mx = max_skip_nan(v, mx);
    if constexpr (kAlibi) dist = dist + dist_step;
  }
  if (t < n) {
    apply(Vec::load_partial(s + t, n - t), grad ? grad + t : nullptr, n - t).store_partial(s + t, n - t);
    if (row_max) mx = max_skip_nan(Vec::load_partial(s + t, n - t, kNegInf), mx);
  }
  if (row_max) mx.store(row_max);
}

struct LogitMods {
  float cap = 0.0f;   // softcap in the logits' units, 0 without
  float unit = 1.0f;  // ALiBi's offsets into the logits' units
  bool any = false;
  // softcap alone goes into the softmax's exp pass (FusedLogit) where no mask is added after it and the logits
  // stay below kExactShiftFrom (simd.h), as they do for any cap below it; ALiBi alone so in the float32 kernel
  // (flash.cpp); else this pass applies them.
  bool fused_softcap = false, fused_alibi = false;
  LogitMods(const AttentionParams& p, float unit_)
      : cap(p.softcap * unit_), unit(unit_), any(has_logit_mods(p)),
        fused_softcap(cap > 0.0f && !p.alibi_slopes && cap < kExactShiftFrom),
        fused_alibi(p.alibi_slopes && !(cap > 0.0f)) {}
  // unit · slope of query head h in batch b, 0 without ALiBi.
  float slope(const AttentionParams& p, int64_t b, int64_t h) const {
    return p.alibi_slopes ? unit * p.alibi_slopes[b * p.alibi_strides[0] + h * p.alibi_strides[1]] : 0.0f;
  }
  // s[t] for t < n, at distance dist0 + step · t (step ±1) from the diagonal.
  void line(const AttentionParams& p, int64_t b, int64_t h, int64_t dist0, int step, float* s, int64_t n, float scale,
            float* grad, float* row_max) const {
    const float sl = slope(p, b, h);
    const int32_t d0 = static_cast<int32_t>(dist0);
    if (cap > 0.0f) {
      if (p.alibi_slopes)
        logit_line<true, true>(s, n, scale, cap, sl, d0, step, grad, row_max);
      else
        logit_line<true, false>(s, n, scale, cap, sl, d0, step, grad, row_max);
    } else if (p.alibi_slopes) {
      logit_line<false, true>(s, n, scale, cap, sl, d0, step, grad, row_max);
    } else {
      logit_line<false, false>(s, n, scale, cap, sl, d0, step, grad, row_max);
    }
  }
  // Query row i against keys [j0, j0 + n).
  void row(const AttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j0, float* s, int64_t n,
           float scale = 1.0f, float* grad = nullptr, float* row_max = nullptr) const {
    line(p, b, h, i + p.kv_len - p.q_len - j0, -1, s, n, scale, grad, row_max);
  }
  // Queries [i0, i0 + n) against key j.
  void column(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t j, float* s, int64_t n,
              float scale = 1.0f, float* grad = nullptr) const {
    line(p, b, h, i0 + p.kv_len - p.q_len - j, 1, s, n, scale, grad, nullptr);
  }
};

// dS = dS · (1 − tanh²) (softcap's derivative) over n entries.
inline void times_softcap_grad(float* ds, const float* grad, int64_t n) {
  for (int64_t t = 0; t < n; ++t) ds[t] *= grad[t];
}

// The call's keep mask, the one place that numbers its entries: entry (i, j) of head bh is counter
// (bh · Nq + i) · Nk + j + offset, and Z = 1 / (1 − p) where dropout_keep keeps that counter, else 0.
struct DropoutZ {
  uint64_t key, threshold, q_len, kv_len, offset;
  float scale;
  explicit DropoutZ(const AttentionParams& p)
      : key(dropout_seed_key(p.dropout_seed)), threshold(dropout_threshold(p.dropout_p)),
        q_len(static_cast<uint64_t>(p.q_len)), kv_len(static_cast<uint64_t>(p.kv_len)), offset(p.dropout_offset),
        scale(1.0f / (1.0f - p.dropout_p)) {}
  uint64_t counter(int64_t bh, int64_t i, int64_t j) const {
    return (static_cast<uint64_t>(bh) * q_len + static_cast<uint64_t>(i)) * kv_len + static_cast<uint64_t>(j) + offset;
  }
  float operator()(uint64_t counter) const { return dropout_keep(key, counter, threshold) ? scale : 0.0f; }
};

// Dropout of row i of head `bh` (= b · num_heads + h) over keys [j0, j0 + n): x[t·stride] *= 1 / (1 − p) where dropout_keep
// (attention.h) keeps entry (i, j0 + t), else 0 (multiplied, so 0 · NaN stays NaN as in IEEE arithmetic).
// The forward applies it to P before P V; the backward to P before dV = Pᵀ dO and to dP before dS.
inline void dropout_row(const AttentionParams& p, int64_t bh, int64_t i, int64_t j0, float* x, int64_t n,
                        int64_t stride) {
  const DropoutZ z(p);
  const uint64_t first = z.counter(bh, i, j0);
  for (int64_t t = 0; t < n; ++t) x[t * stride] *= z(first + t);
}

// Column j of the keep mask over query rows [i0, i0 + n) of head `bh`: z[c] = 1 / (1 − p) where dropout_keep keeps
// entry (i0 + c, j), else 0. The bf16 backward's transposed tiles (keys as rows, queries as columns) take Z this way.
inline void dropout_column(const AttentionParams& p, int64_t bh, int64_t i0, int64_t j, float* z, int64_t n) {
  const DropoutZ keep(p);
  const uint64_t first = keep.counter(bh, i0, j);
  for (int64_t c = 0; c < n; ++c) z[c] = keep(first + static_cast<uint64_t>(c) * keep.kv_len);
}

// Whether n rows of d values (ld apart) are all finite: a V tile that is not takes P V row by row over the keys
// each row sees, in a block attn_mask cuts, since P = 0 at a hidden key would still multiply its NaN (and in the
// backward a K tile that is not takes dQ += dS K so: dS = 0 at a hidden key would multiply its inf). Read by the
// exponent bits of each element, not all ones (integer tests the compiler vectorises, no conversion).
template <class T>
bool rows_finite(const T* x, int64_t ld, int64_t n, int64_t d) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
  static_assert(sizeof(Bits) == sizeof(T));
  constexpr Bits exponent = sizeof(T) == 4 ? Bits(0x7f800000u) : std::is_same_v<T, c10::Half> ? Bits(0x7c00u)
                                                                                                : Bits(0x7f80u);
  Bits any_special = 0;
  for (int64_t t = 0; t < n; ++t) {
    const T* row = x + t * ld;
    for (int64_t c = 0; c < d; ++c) {
      Bits bits;
      std::memcpy(&bits, row + c, sizeof bits);
      any_special |= static_cast<Bits>((bits & exponent) == exponent);
    }
  }
  return any_special == 0;
}

// How the packing of the key tiles is split among the threads: each tile in `chunks` chunks of `keys` keys (whole
// units: a panel or a VNNI block), about eight chunks a thread where the tiles allow, taken dynamically. Small calls
// have few tiles for many threads (4 or 12 heads × one tile of 1024 keys on 16 threads): packed a tile a task, the
// packing phase lasted a whole tile's packing while the other threads waited at its barrier; in a few large chunks
// a thread still got a tile's worth (12 tiles in 36 chunks: three chunks for some threads).
struct PackChunks {
  int64_t keys = 0, chunks = 1;  // keys per chunk (the last may hold fewer), chunks per tile
};
inline PackChunks split_packing(const AttentionParams& p, int64_t Tc, int64_t tile_keys, int64_t unit) {
  const int64_t tiles = p.batch * p.num_kv_heads * Tc, units = (tile_keys + unit - 1) / unit;
  const int64_t wanted = std::clamp<int64_t>((8 * p.num_threads + tiles - 1) / tiles, 1, units);
  const int64_t keys = (units + wanted - 1) / wanted * unit;
  return {keys, (tile_keys + keys - 1) / keys};
}

// Whether every chunk of a key tile was found finite (flags[c] = 1 if chunk c holds no NaN or inf).
inline bool all_chunks_finite(const float* flags, int64_t chunks) {
  for (int64_t c = 0; c < chunks; ++c)
    if (flags[c] == 0.0f) return false;
  return true;
}

// Packing counters (run_forward_tiles): int64s a cache line apart, so that a tile's polling of one never meets the
// increments of another; kCounterFloats floats of workspace each.
constexpr int64_t kCounterStride = 8, kCounterFloats = 2 * kCounterStride;

// Spins until *counter ≥ value (acquire: what was written before the increments that got it there is visible).
// PAUSE between reads; after a while the thread yields its core instead, in case the thread it waits for is not
// running (more threads than cores). The forward's packing counters and the one-pass backward's merge turns.
inline void wait_for_count(const int64_t* counter, int64_t value) {
  for (int spins = 0; __atomic_load_n(counter, __ATOMIC_ACQUIRE) < value; ++spins) {
    if (spins < 4096)
      spin_pause();
    else
      std::this_thread::yield();
  }
}

// The forward's jobs on one team of threads (flash.cpp, flash_bf16.cpp), taken dynamically:
//   pack(b, kvh, u): packing unit u < packs of kv head (b, kvh) — a chunk of one of its key tiles (PackChunks) —
//      into the shared workspace, once (none with packs = 0: flash.cpp's tasks that pack their own);
//   tile(b, h, i0, scratch): a query tile, which reads its kv head's packed tiles; the tiles of a head costliest
//      first (with the causal mask the last query tiles see the most keys), each thread on its own scratch.
// No barrier stands between the two. The jobs come kv head by kv head: the first kv head's chunks, then each kv head's
// query tiles with the next one's chunks spread evenly among them (the first at the start, the last well before the
// next kv head's first tile), then the last one's tiles; a tile waits only until its own kv head's chunks are all
// packed (`ready` counts them: release after a chunk, acquire before a tile). The packing — bound by the caches and
// memory, not by the FMAs or tiles — so runs beside the products of the kv head before, where behind a barrier it was a
// phase of its own on every thread: on a 16-core Xeon 55–350 µs of 0.25–2.4 ms calls, however finely it was
// split. No wait can block forever, whatever order the jobs are handed out in: every chunk of
// a kv head comes before its first tile in the order, so the waiting tile of lowest index waits for chunks of lower
// index, each packed, being packed, or still to be taken by a thread whose current job has a lower index still — a
// chunk, or a tile that does not wait.
// With a batch-shared attn_mask the tasks take the batch innermost (below): then the order's unit is a kv head index
// over the whole batch (its chunks for every batch element, then its tiles), not one (batch, kv head).
// `ready` holds one counter per (batch, kv head), kCounterStride apart, in the workspace; zeroed here. PerThread is
// constructed by each thread around its jobs (flash_bf16.cpp: AMX's tile configuration).
struct NoPerThreadSetup {};
template <class PerThread = NoPerThreadSetup, class Pack, class Tile>
void run_forward_tiles(const AttentionParams& p, int64_t Br, int64_t Tr, int64_t packs, int64_t* ready,
                       float* thread_scratch, int64_t per_thread, const Pack& pack, const Tile& tile) {
  const int64_t kv_heads = p.batch * p.num_kv_heads, n_tasks = p.batch * p.num_heads * Tr;
  // Tasks are (batch, head, query tile), kv head by kv head (the heads of a GQA group are adjacent). An attn_mask
  // shared by the batch (stride 0 over b: an ALiBi-style (1, H, N, N) bias) is read by every batch's tile i of head
  // h: then the batch is the innermost index, so those tasks run one after another and its rows come from cache
  // after the first, not from memory once per batch element.
  const bool batch_inner = p.mask != nullptr && p.batch > 1 && p.mask_strides[0] == 0;
  // The order's units: (batch, kv head) pairs, or kv head indices with the batch innermost; each unit's chunks and
  // tasks.
  const int64_t units = batch_inner ? p.num_kv_heads : kv_heads;
  const int64_t unit_packs = kv_heads * packs / units, unit_tasks = n_tasks / units;
  const auto run_task = [&](int64_t task, float* scratch) {
    int64_t b, h, i;
    if (batch_inner) {
      b = task % p.batch, i = Tr - 1 - (task / p.batch) % Tr, h = task / (p.batch * Tr);
    } else {
      i = Tr - 1 - task % Tr, h = (task / Tr) % p.num_heads, b = task / (Tr * p.num_heads);
    }
    if (packs > 0) wait_for_count(ready + (b * p.num_kv_heads + kv_head(p, h)) * kCounterStride, packs);
    tile(b, h, i * Br, scratch);
  };
  const auto run_pack = [&](int64_t unit, int64_t c) {  // chunk c of a unit
    const int64_t kv = batch_inner ? c / packs * p.num_kv_heads + unit : unit, u = c % packs;
    pack(kv / p.num_kv_heads, kv % p.num_kv_heads, u);
    __atomic_fetch_add(ready + kv * kCounterStride, 1, __ATOMIC_RELEASE);
  };
  std::fill_n(ready, packs > 0 ? kv_heads * kCounterStride : 0, int64_t{0});
  const int64_t n_jobs = kv_heads * packs + n_tasks;
#pragma omp parallel num_threads(p.num_threads)
  {
    float* scratch = thread_scratch + omp_get_thread_num() * per_thread;
    const PerThread setup;
#pragma omp for schedule(dynamic, 1)
    for (int64_t job = 0; job < n_jobs; ++job) {
      if (job < unit_packs) {  // the first unit's chunks
        run_pack(0, job);
        continue;
      }
      // Block k (of unit_tasks + unit_packs jobs): unit k's tiles, and unit k + 1's chunks at the positions
      // ⌊c · block / unit_packs⌋, c < unit_packs (evenly spread, from r = 0); the last block holds tiles only.
      // Before position r lie ⌈r · unit_packs / block⌉ chunks.
      const int64_t block = unit_tasks + unit_packs, k = (job - unit_packs) / block, r = (job - unit_packs) % block;
      const bool chunks_follow = k + 1 < units && unit_packs > 0;
      const int64_t chunks_before = chunks_follow ? (r * unit_packs + block - 1) / block : 0;
      if (chunks_follow && ((r + 1) * unit_packs + block - 1) / block > chunks_before)
        run_pack(k + 1, chunks_before);
      else
        run_task(k * unit_tasks + r - chunks_before, scratch);
    }
  }
}

// The end of a query tile: rows [i0, i0 + rows) of head h, O = O_i / l and lse = m + log(l) (m in base 2:
// lse = ln 2 · (m + log2(l))), O_i's rows ldo floats apart. Rows that saw no key (l = 0): O = 0, lse = −inf. A NaN l (a NaN or +inf logit) gives NaN in
// both: hence `l == 0`, never `l > 0`, which would read NaN as "no key".
template <class T>
void finish_rows(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t rows, const float* Oi,
                 int64_t ldo, const float* m, const float* l, bool base2 = false) {
  T* out = out_head<T>(p, b, h) + i0 * p.out_strides[2];
  for (int64_t r = 0; r < rows; ++r) {
    const float inv_l = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
#if defined(CS149_ISA_AVX512)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {  // 16 at a time, rounded as c10::BFloat16 rounds (simd.h)
      store_scaled_bf16(Oi + r * ldo, inv_l, p.head_dim, reinterpret_cast<uint16_t*>(out + r * p.out_strides[2]));
      continue;
    }
#endif
    for (int64_t c = 0; c < p.head_dim; ++c) out[r * p.out_strides[2] + c] = static_cast<T>(Oi[r * ldo + c] * inv_l);
  }
  if (p.lse) {
    float* lse = p.lse + b * p.lse_strides[0] + h * p.lse_strides[1] + i0;
    constexpr float kLn2 = 0.693147180559945309f;
    for (int64_t r = 0; r < rows; ++r)
      lse[r] = l[r] == 0.0f ? kNegInf : base2 ? kLn2 * (m[r] + std::log2(l[r])) : m[r] + std::log(l[r]);
  }
}

}  // namespace flash
}  // namespace CS149_ISA
}  // namespace cs149gpt
