// FlashAttention-2's backward in one pass (Dao, 2023, Algorithm 2): S and dP once per (query tile, key tile).
//
// With S = Q Kᵀ, P = exp(scale·S − lse) (the forward's softmax, recomputed from its saved lse), Z dropout's keep
// mask / (1 − p) (regenerated from the forward's seed; 1 without dropout) and dO = ∂L/∂O:
//   D   = rowsum(dO ∘ O)                 one number per query row, once per task
//   for each key tile j:                 dK_j = dV_j = 0
//     for each query tile i that sees a key of tile j:
//       S    = Q_i K_jᵀ                   P = exp(scale·S − lse), 0 for keys the row does not see
//       dP   = (dO_i V_jᵀ) ∘ Z            dS = P ∘ (dP − D)
//       dV_j += (P ∘ Z)ᵀ dO_i
//       dK_j += dSᵀ Q_i                   (× scale when written)
//       dQ_i += dS K_j                    (× scale when written)
// Five tile products per tile pair, where the two-pass kernel (flash_backward.cpp) recomputes S and dP in each of
// its passes and does seven. attn_mask enters as in the forward (mask_block, flash_common.h): a tile pair it hides
// whole is skipped, one it cuts adds its offsets to scale·S, and dS is 0 at the keys it hides.
//
// No two threads ever write the same gradient row, without atomics: one task per (batch, kv head) owns the dQ
// rows of every query head of its group (accumulated in float32 in the thread's scratch, in the fixed order of
// the key tiles) and the dK, dV rows of its kv head (the group's heads summed in a fixed order). Where there are
// too few kv heads for the CPUs (or too few for the dynamic schedule to even out the CPUs' speeds), heuristics.h splits
// each one's key tiles into key_chunks runs: a task per run, its partial dQ accumulated in its thread's scratch as
// without runs, then merged into the kv head's dQ sum in the order of the runs — a task waits for the previous run's
// merge (taken earlier: tasks are handed out in order, chunk by chunk) — and the sum scaled once all are in.
// float32 with many query heads on few kv heads (MQA: Gemma's 8 on 1) splits the group's query heads too, into
// head_parts: a task per (run, part) owns the dQ rows of its part's heads, and the parts' shares of each key tile's
// dK_j, dV_j are added into dk, dv in part order, a task waiting for the previous part's share of that tile.
// Either way the bits of the result do not depend on the number of threads. heuristics.h picks this kernel when its
// tasks keep the machine's CPUs busy (BackwardPath::one_pass); the two-pass kernel otherwise.
//
// Memory: per thread, one task's dQ accumulator, D and lse (its group's query rows) and the tiles; nothing is
// packed for the whole tensor. With runs, the dQ sums live in dq itself where it is float32, else in the
// workspace. Q_i and dO_i are converted into float32 tiles for each tile pair (Br·d values against the pair's
// 10·Br·Bc·d FLOPs), K_jᵀ, V_jᵀ and K_j once per key tile (K_j is read in place where it is
// float32 rows of whole vectors already).
//
// Which keys a query row sees is decided in one place, visible_key_range(); everything else follows from it.
#include "flash_common.h"

#include <algorithm>
#include <numeric>
#include <omp.h>

namespace cs149gpt {
namespace CS149_ISA {
namespace flash_backward_onepass {

using namespace flash;

constexpr int64_t kDefaultBlockQ = tiles::kOnePassRowGroups * kRowGroup;  // 96 rows with AVX-512, 48 with AVX2
// Key tiles: multiples of kKeyAlign (flash_common.h); by head_dim (heuristics.h).
inline int64_t default_block_k(int64_t head_dim) { return round_up(tiles::one_pass_block_k(head_dim), kKeyAlign); }
constexpr int64_t kMaxTile = 512;
constexpr int64_t kMaxRows = (kMaxTile + kRowGroup - 1) / kRowGroup * kRowGroup;  // Br ≤ this

// Keys [begin, end) of query row i of query head h in batch b: the causal prefix, within the sliding window and
// attn_mask's key ranges (a padded batch's mask, one run of keys a row: mask_ranges.cpp's key_ranges_of) where there are
// any; none for the padding rows past q_len. The rows of a padded sequence end early, those of a window start late:
// a key outside the range is never read for the row, exactly as one past the causal diagonal.
struct KeyRange {
  int64_t begin, end;
};
inline KeyRange visible_key_range(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
  if (i >= p.q_len) return {0, 0};
  const int64_t causal_end = visible_keys(p, i);
  if (!has_window(p)) return {0, causal_end};
  const int64_t begin = std::clamp<int64_t>(window_first(p, b, h, i), 0, causal_end);
  return {begin, std::clamp<int64_t>(window_last(p, b, h, i) + 1, begin, causal_end)};
}
// The same, relative to a key tile [j0, j0 + n_keys) and clamped to it (begin == end: none).
inline KeyRange visible_in_tile(const AttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j0,
                                int64_t n_keys) {
  const KeyRange r = visible_key_range(p, b, h, i);
  const int64_t begin = std::clamp<int64_t>(r.begin - j0, 0, n_keys), end = std::clamp<int64_t>(r.end - j0, 0, n_keys);
  return {begin, std::max(begin, end)};
}

// Key runs (heuristics.h's key_chunks), in this kernel and in flash_backward_bf16.cpp. Run r of a kv head adds its
// partial dQ to the kv head's sum once runs 0 .. r − 1 have added theirs, so that every sum is
// ((dQ_0 + dQ_1) + dQ_2) + ..., whatever thread ran which run and when. What orders them heads the shared workspace:
// the task counter on a cache line of its own (threads waiting for a turn do not slow the others taking tasks), then
// the merge turns (int64s, two floats each): a kv head's, how many of its runs have added theirs; here also, with
// head parts, a (kv head, part)'s, and a key tile's, how many parts have added their dK_j, dV_j.
namespace key_runs {
inline int64_t header_floats(int64_t turns) { return round_up(16 + 2 * turns, 16); }
inline int64_t* task_counter(float* ws) { return reinterpret_cast<int64_t*>(ws); }
inline int64_t* merge_turn(float* ws, int64_t turn) { return reinterpret_cast<int64_t*>(ws + 16) + turn; }
inline void reset(float* ws, int64_t turns) {
  *task_counter(ws) = 0;
  std::fill(merge_turn(ws, 0), merge_turn(ws, turns), int64_t{0});
}
// Every thread takes tasks in the order of t — chunk by chunk (t / pairs; under a causal mask the first keys meet
// the most query rows, so go first), or, flash_backward_bf16.cpp on one thread, kv head by kv head: a run's
// predecessor, `pairs` tasks earlier or the one before (here, with head parts, the previous part is the task
// before), is then always running or done when the run waits for its turn.
template <class Task>
void take_in_order(float* ws, int64_t tasks, const Task& task) {
  for (int64_t t; (t = __atomic_fetch_add(task_counter(ws), 1, __ATOMIC_RELAXED)) < tasks;) task(t);
}
// Waiting for turn `turn` to reach `run` (whose go it is: a run, or a head part), flash_common.h's spin-wait: the
// count never passes `run` before `run` itself ends its turn, so "at least run" is "run".
inline void wait_for_turn(float* ws, int64_t turn, int64_t run) { wait_for_count(merge_turn(ws, turn), run); }
inline void end_turn(float* ws, int64_t turn, int64_t run) {
  __atomic_store_n(merge_turn(ws, turn), run + 1, __ATOMIC_RELEASE);
}
}  // namespace key_runs

struct Layout {
  int64_t Br, Bc, Tr, Tc, q_pad, d_pad, group_size, chunks, pairs, tasks, threads;
  // The group's query heads in head_parts parts of part_heads each (float32 only: the parts' dK, dV shares are
  // added in dk, dv themselves); merge turns: a (kv head, part)'s dQ sum, then with parts a key tile's dK_j, dV_j.
  int64_t head_parts, part_heads, turns;
  // K_j by rows (B of dQ_i += dS K_j) read in place from k: float32 rows of whole vectors (no padding to add). Saves
  // Bc x d_pad floats per thread: (1,12,1024,64) with 192-key tiles stays under torch SDPA's backward memory.
  bool k_rows_in_place;
  // shared, with key chunks: key_runs' header, then the dQ sums of the kv heads (pairs × group_size × q_pad × d_pad)
  // unless they are summed in dq itself (float32).
  bool dq_sums_in_place;
  int64_t dq_sums, shared;
  // per thread: dQ of the task's heads (part_heads × q_pad × d_pad), D and lse (part_heads × q_pad);
  // K_jᵀ, V_jᵀ (d × Bc), K_j (Bc × d_pad, unless read in place); Q_i, dO_i (Br × d_pad); P, dS (Br × Bc); dK_j, dV_j (Bc × d_pad); ones;
  // with attn_mask, its offsets over a tile pair (Br × Bc)
  int64_t dq_off, delta_off, lse_off, kt_off, vt_off, kr_off, qi_off, doi_off, p_off, ds_off, dk_off, dv_off, ones_off,
      bias_off, per_thread;

  explicit Layout(const AttentionBackwardParams& bp) {
    const AttentionParams& p = bp.fwd;
    // A caller's tile is clamped to the sequence (checks.cpp) before it is rounded up.
    Br = p.block_q > 0 ? round_up(std::min(p.block_q, p.q_len), kRowGroup) : kDefaultBlockQ;
    Bc = p.block_k > 0 ? round_up(std::min(p.block_k, p.kv_len), kKeyAlign) : default_block_k(p.head_dim);
    // At most kMaxTile: the tiles' scratch (Br × Bc) stays small whatever a caller asks.
    Br = std::min({Br, round_up(p.q_len, kRowGroup), kMaxRows});
    Bc = std::min({Bc, round_up(p.kv_len, kKeyAlign), round_up(kMaxTile, kKeyAlign)});
    Tr = (p.q_len + Br - 1) / Br;
    Tc = (p.kv_len + Bc - 1) / Bc;
    q_pad = Tr * Br;
    d_pad = round_up(p.head_dim, W);
    k_rows_in_place = p.dtype == DType::f32 && d_pad == p.head_dim;
    group_size = p.num_heads / p.num_kv_heads;
    chunks = std::clamp<int64_t>(bp.key_chunks, 1, Tc);
    pairs = p.batch * p.num_kv_heads;
    head_parts = p.dtype == DType::f32 ? std::gcd(std::max<int64_t>(bp.head_parts, 1), group_size) : 1;
    part_heads = group_size / head_parts;
    tasks = pairs * chunks * head_parts;
    threads = std::max<int64_t>(1, std::min<int64_t>(p.num_threads, tasks));
    const int64_t dq_size = part_heads * q_pad * d_pad;
    dq_sums_in_place = p.dtype == DType::f32;
    turns = pairs * head_parts + (head_parts > 1 ? pairs * Tc : 0);
    dq_sums = key_runs::header_floats(turns);
    shared = chunks > 1 || head_parts > 1 ? dq_sums + (dq_sums_in_place ? 0 : pairs * group_size * q_pad * d_pad) : 0;
    dq_off = 0;
    delta_off = dq_off + dq_size;
    lse_off = delta_off + part_heads * q_pad;
    kt_off = lse_off + part_heads * q_pad;
    vt_off = kt_off + p.head_dim * Bc;
    kr_off = vt_off + p.head_dim * Bc;
    qi_off = kr_off + (k_rows_in_place ? 0 : Bc * d_pad);
    doi_off = qi_off + Br * d_pad;
    p_off = doi_off + Br * d_pad;
    ds_off = p_off + Br * Bc;
    dk_off = ds_off + Br * Bc;
    dv_off = dk_off + Bc * d_pad;
    ones_off = dv_off + Bc * d_pad;
    bias_off = round_up(ones_off + std::max(Br, Bc), 16);
    per_thread = bias_off + (p.mask_kind != MaskKind::none ? Br * Bc : 0);
  }
};

template <class T>
const T* row_of(const void* base, const int64_t (&strides)[3], int64_t b, int64_t h, int64_t i) {
  return static_cast<const T*>(base) + b * strides[0] + h * strides[1] + i * strides[2];
}

// D = rowsum(dO ∘ O) and lse for every query row of head h (rows past q_len: 0 and +inf, never read).
template <class T>
void row_statistics(const AttentionBackwardParams& bp, const Layout& L, int64_t b, int64_t h, float* delta,
                    float* lse) {
  const AttentionParams& p = bp.fwd;
  for (int64_t i = 0; i < L.q_pad; ++i) {
    if (i >= p.q_len) {
      delta[i] = 0.0f;
      lse[i] = std::numeric_limits<float>::infinity();
      continue;
    }
    const T* g = row_of<T>(bp.dout, bp.dout_strides, b, h, i);
    const T* o = row_of<T>(p.out, p.out_strides, b, h, i);
    if constexpr (std::is_same_v<T, float>) {
      delta[i] = dot(g, o, p.head_dim);  // in vectors: a scalar sum is one chain of dependent adds (~4 cycles each)
    } else {
      float sum = 0.0f;
      for (int64_t c = 0; c < p.head_dim; ++c) sum += to_float(g[c]) * to_float(o[c]);
      delta[i] = sum;
    }
    // A row whose logits all weigh 0 (lse = −inf) has P = 0: with +inf in its place, exp(S − inf) = 0 where
    // exp(S + inf) would be inf. (A NaN lse, from a NaN row, stays NaN and so do its P.)
    const float l = p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i];
    lse[i] = l == kNegInf ? std::numeric_limits<float>::infinity() : l;
  }
}

// rows [i0, i0 + Br) of a (b, h, i) tensor as float32, d_pad columns, zero past q_len and head_dim.
template <class T>
void pack_rows(const void* base, const int64_t (&strides)[3], const AttentionParams& p, const Layout& L, int64_t b,
               int64_t h, int64_t i0, float* out) {
  fill_row(0.0f, out, L.Br * L.d_pad);
  const int64_t rows = std::min(L.Br, p.q_len - i0);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = row_of<T>(base, strides, b, h, i0 + r);
    for (int64_t c = 0; c < p.head_dim; ++c) out[r * L.d_pad + c] = to_float(src[c]);
  }
}

// Key tile j of kv head (b, kvh): K_jᵀ and V_jᵀ (d × Bc), K_j by rows (Bc × d_pad, unless L.k_rows_in_place); zero
// past the keys.
template <class T>
void pack_key_tile(const AttentionParams& p, const Layout& L, int64_t b, int64_t kvh, int64_t j0, float* kt,
                   float* vt, float* kr) {
  const int64_t d = p.head_dim, cols = std::min(L.Bc, p.kv_len - j0);
  fill_row(0.0f, kt, d * L.Bc);
  fill_row(0.0f, vt, d * L.Bc);
  if (!L.k_rows_in_place) fill_row(0.0f, kr, L.Bc * L.d_pad);
  if constexpr (std::is_same_v<T, float>) {  // 16 × 16 blocks through registers (simd.h), not a store per value
    const int64_t k_ld = p.k_strides[2], v_ld = p.v_strides[2];
    const T* K = row_of<T>(p.k, p.k_strides, b, kvh, j0);
    const T* V = row_of<T>(p.v, p.v_strides, b, kvh, j0);
    transpose_block(K, k_ld, cols, d, 1.0f, kt, L.Bc);
    transpose_block(V, v_ld, cols, d, 1.0f, vt, L.Bc);
    if (!L.k_rows_in_place)
      for (int64_t t = 0; t < cols; ++t) std::copy(K + t * k_ld, K + t * k_ld + d, kr + t * L.d_pad);
    return;
  }
  for (int64_t t = 0; t < cols; ++t) {
    const T* k = row_of<T>(p.k, p.k_strides, b, kvh, j0 + t);
    const T* v = row_of<T>(p.v, p.v_strides, b, kvh, j0 + t);
    for (int64_t c = 0; c < d; ++c) {
      kt[c * L.Bc + t] = to_float(k[c]);
      vt[c * L.Bc + t] = to_float(v[c]);
    }
    if (!L.k_rows_in_place)
      for (int64_t c = 0; c < d; ++c) kr[t * L.d_pad + c] = to_float(k[c]);
  }
}

// One tile pair: query rows [i0, i0 + Br) of head h against key tile [j0, j0 + n_keys), whose K_jᵀ, V_jᵀ, K_j are
// packed (k_finite: K_j holds no NaN or infinity). Accumulates into dK_j, dV_j (scratch) and the task's dQ rows.
template <class T>
void tile_pair(const AttentionBackwardParams& bp, const Layout& L, int64_t b, int64_t h, int64_t i0, int64_t j0,
               int64_t n_keys, bool k_finite, const float* delta, const float* lse, float* dQ, float* scratch) {
  const AttentionParams& p = bp.fwd;
  const int64_t d = p.head_dim, d_pad = L.d_pad, Bc = L.Bc;
  // Which rows see which keys of this tile; the products run over the rows and keys that some row sees.
  KeyRange ranges[kMaxRows];  // one per row of the tile
  int64_t first_row = L.Br, last_row = 0, max_end = 0;
  for (int64_t r = 0; r < L.Br; ++r) {
    ranges[r] = visible_in_tile(p, b, h, i0 + r, j0, n_keys);
    if (ranges[r].end > ranges[r].begin) {
      first_row = std::min(first_row, r);
      last_row = r + 1;
      max_end = std::max(max_end, ranges[r].end);
    }
  }
  if (first_row >= last_row) return;
  // attn_mask over the pair: hidden whole, nothing to do; cut (partial), its offsets in bias, rows Bc apart.
  float* bias = scratch + L.bias_off;
  const MaskBlock block = p.mask_kind == MaskKind::none
                              ? MaskBlock::visible
                              : mask_block(p, b, h, i0, std::min(L.Br, p.q_len - i0), j0, n_keys, bias, Bc, 1);
  if (block == MaskBlock::hidden) return;
  const bool partial = block == MaskBlock::partial;
  const int64_t n_cols = round_up(max_end, kKeyAlign);  // whole vectors (S's columns), whole row groups (dK's rows)

  float *Qi = scratch + L.qi_off, *dOi = scratch + L.doi_off, *P = scratch + L.p_off, *dS = scratch + L.ds_off;
  const float *KTj = scratch + L.kt_off, *VTj = scratch + L.vt_off;
  // K_j by rows, k_ld apart: the packed copy, or k itself (float32 rows of d_pad values; only the visible keys of
  // the tile, [0, n_keys), are read below).
  const float* Kj = scratch + L.kr_off;
  int64_t k_ld = d_pad;
  if (L.k_rows_in_place) {
    Kj = static_cast<const float*>(p.k) + b * p.k_strides[0] + kv_head(p, h) * p.k_strides[1] + j0 * p.k_strides[2];
    k_ld = p.k_strides[2];
  }
  float *dK = scratch + L.dk_off, *dV = scratch + L.dv_off;
  const float* ones = scratch + L.ones_off;
  pack_rows<T>(p.q, p.q_strides, p, L, b, h, i0, Qi);
  pack_rows<T>(bp.dout, bp.dout_strides, p, L, b, h, i0, dOi);

  // S = Q_i K_jᵀ into P, dP = dO_i V_jᵀ into dS, for the row groups [r0, r1) that hold a row seeing a key here
  const int64_t r0 = first_row / kRowGroup * kRowGroup, r1 = round_up(last_row, kRowGroup);
  group_gemm<kQkVecs>(r1 - r0, d, Qi + r0 * d_pad, d_pad, 1, KTj, Bc, n_cols, P + r0 * Bc, Bc, nullptr);
  group_gemm<kQkVecs>(r1 - r0, d, dOi + r0 * d_pad, d_pad, 1, VTj, Bc, n_cols, dS + r0 * Bc, Bc, nullptr);

  // P = exp(scale·S [+ mask] − lse), dS = P ∘ (dP ∘ Z − D), then P ∘ Z for dV; all 0 outside each row's visible
  // keys and where the mask hides a key (there dP may be NaN, from a hidden value row: 0 · NaN must not leak).
  const int64_t bh = b * p.num_heads + h;
  for (int64_t r = r0; r < r1; ++r) {
    float *pr = P + r * Bc, *dsr = dS + r * Bc;
    const KeyRange k = ranges[r];
    if (k.end <= k.begin) {
      fill_row(0.0f, pr, n_cols);
      fill_row(0.0f, dsr, n_cols);
      continue;
    }
    const int64_t n = k.end - k.begin;
    const float* bias_row = bias + r * Bc + k.begin;  // (a row that sees a key is a real row: mask_block filled it)
    if (partial) {
      add_mask(pr + k.begin, bias_row, n, /*unit=*/1.0f, /*scale=*/p.scale);  // scale·S + mask, −inf where hidden
      exp_shifted_sum(pr + k.begin, lse[i0 + r], n, 1.0f);
    } else {
      exp_shifted_sum(pr + k.begin, lse[i0 + r], n, p.scale);
    }
    fill_row(0.0f, pr, k.begin);
    fill_row(0.0f, pr + k.end, n_cols - k.end);
    if (p.dropout_p > 0.0f) dropout_row(p, bh, i0 + r, j0 + k.begin, dsr + k.begin, n, 1);
    const Vec D = Vec::broadcast(delta[i0 + r]);
    for (int64_t c = 0; c < n_cols; c += W) (Vec::load(pr + c) * (Vec::load(dsr + c) - D)).store(dsr + c);
    fill_row(0.0f, dsr, k.begin);
    fill_row(0.0f, dsr + k.end, n_cols - k.end);
    if (partial) zero_where_hidden(dsr + k.begin, bias_row, n);
    if (p.dropout_p > 0.0f) dropout_row(p, bh, i0 + r, j0 + k.begin, pr + k.begin, n, 1);
  }

  // dV_j += (P ∘ Z)ᵀ dO_i, dK_j += dSᵀ Q_i   (n_cols key rows; k runs over the query rows that see a key here)
  const int64_t k_rows = last_row - first_row;
  group_gemm<kPvVecs>(n_cols, k_rows, P + first_row * Bc, 1, Bc, dOi + first_row * d_pad, d_pad, d_pad, dV, d_pad,
                      ones);
  group_gemm<kPvVecs>(n_cols, k_rows, dS + first_row * Bc, 1, Bc, Qi + first_row * d_pad, d_pad, d_pad, dK, d_pad,
                      ones);

  // dQ_i += dS K_j, a row group at a time: the keys every row of the group sees through the micro-kernel, each
  // row's others one by one, so that a hidden key's K (maybe inf or NaN) never meets a row (0 · inf = NaN). Where
  // the mask cuts the pair and K_j is not all finite, every row adds the keys it shows one by one.
  float* dQi = dQ + i0 * d_pad;
  if (partial && !k_finite) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t t = ranges[r].begin; t < ranges[r].end; ++t)
        if (bias[r * Bc + t] != kNegInf) axpy(dS[r * Bc + t], Kj + t * k_ld, dQi + r * d_pad, d);
    return;
  }
  for (int64_t g0 = r0; g0 < r1; g0 += kRowGroup) {
    int64_t shared_begin = 0, shared_end = n_cols;
    for (int64_t r = g0; r < g0 + kRowGroup; ++r) {
      if (i0 + r >= p.q_len) break;  // padding rows: their dQ is never written out
      shared_begin = std::max(shared_begin, ranges[r].begin);
      shared_end = std::min(shared_end, ranges[r].end);
    }
    shared_end = std::max(shared_begin, shared_end);
    if (shared_end > shared_begin)
      group_gemm<kPvVecs>(kRowGroup, shared_end - shared_begin, dS + g0 * Bc + shared_begin, Bc, 1,
                          Kj + shared_begin * k_ld, k_ld, d_pad, dQi + g0 * d_pad, d_pad, ones);
    for (int64_t r = g0; r < g0 + kRowGroup; ++r) {
      const KeyRange k = ranges[r];
      const float* dsr = dS + r * Bc;
      float* dq = dQi + r * d_pad;
      if (shared_end > shared_begin) {  // the row's keys outside the shared ones
        if (k.begin < shared_begin)
          weighted_row_sum<true>(dsr + k.begin, Kj + k.begin * k_ld, k_ld, shared_begin - k.begin, dq, d_pad);
        if (k.end > shared_end)
          weighted_row_sum<true>(dsr + shared_end, Kj + shared_end * k_ld, k_ld, k.end - shared_end, dq, d_pad);
      } else if (k.end > k.begin) {
        weighted_row_sum<true>(dsr + k.begin, Kj + k.begin * k_ld, k_ld, k.end - k.begin, dq, d_pad);
      }
    }
  }
}

// The key tiles of chunk c of C: [c·Tc/C, (c+1)·Tc/C).
inline int64_t chunk_start(const Layout& L, int64_t c) { return c * L.Tc / L.chunks; }

// Row i of query head g of kv head (b, kvh)'s dQ sum: in dq itself (float32), else in the workspace.
inline float* dq_sum_row(const AttentionBackwardParams& bp, const Layout& L, float* ws, int64_t b, int64_t kvh,
                         int64_t g, int64_t i) {
  const AttentionParams& p = bp.fwd;
  if (L.dq_sums_in_place)
    return static_cast<float*>(bp.dq) + b * bp.dq_strides[0] + (kvh * L.group_size + g) * bp.dq_strides[1] +
           i * bp.dq_strides[2];
  return ws + L.dq_sums + ((b * p.num_kv_heads + kvh) * L.group_size * L.q_pad + g * L.q_pad + i) * L.d_pad;
}

// Run `chunk`'s share of the dQ of part `part`'s query heads (its thread's dQ) into their sums, after the previous
// run's.
inline void merge_chunk(const AttentionBackwardParams& bp, const Layout& L, int64_t b, int64_t kvh, int64_t chunk,
                        int64_t part, const float* dQ, float* ws) {
  const AttentionParams& p = bp.fwd;
  const int64_t turn = (b * p.num_kv_heads + kvh) * L.head_parts + part;
  key_runs::wait_for_turn(ws, turn, chunk);
  for (int64_t gl = 0; gl < L.part_heads; ++gl)
    for (int64_t i = 0; i < p.q_len; ++i) {
      float* sum = dq_sum_row(bp, L, ws, b, kvh, part * L.part_heads + gl, i);
      const float* share = dQ + (gl * L.q_pad + i) * L.d_pad;
      if (chunk == 0)
        for (int64_t e = 0; e < p.head_dim; ++e) sum[e] = share[e];
      else
        for (int64_t e = 0; e < p.head_dim; ++e) sum[e] += share[e];
    }
  key_runs::end_turn(ws, turn, chunk);
}

// The task of chunk `chunk` and head part `part` of kv head kvh in batch b: the part's query heads' shares of dK, dV
// of the chunk's keys (written out, or with several parts added in part order), and the chunk's share of their dQ,
// into dQ (its thread's, part_heads × q_pad × d_pad); written out here when the task has all the keys, else merged
// into the dQ sums.
template <class T>
void kv_head_task(const AttentionBackwardParams& bp, const Layout& L, int64_t b, int64_t kvh, int64_t chunk,
                  int64_t part, float* dQ, float* scratch, float* ws) {
  const AttentionParams& p = bp.fwd;
  const int64_t d = p.head_dim, d_pad = L.d_pad, h0 = kvh * L.group_size + part * L.part_heads;
  const int64_t pair = b * p.num_kv_heads + kvh;
  float *delta = scratch + L.delta_off, *lse = scratch + L.lse_off;
  float *dK = scratch + L.dk_off, *dV = scratch + L.dv_off;
  fill_row(0.0f, dQ, L.part_heads * L.q_pad * d_pad);
  for (int64_t g = 0; g < L.part_heads; ++g)
    row_statistics<T>(bp, L, b, h0 + g, delta + g * L.q_pad, lse + g * L.q_pad);

  for (int64_t j = chunk_start(L, chunk); j < chunk_start(L, chunk + 1) && j * L.Bc < p.kv_len; ++j) {
    const int64_t j0 = j * L.Bc, n_keys = std::min(L.Bc, p.kv_len - j0);
    pack_key_tile<T>(p, L, b, kvh, j0, scratch + L.kt_off, scratch + L.vt_off, scratch + L.kr_off);
    const bool k_finite = p.mask_kind == MaskKind::none ||
                          rows_finite(row_of<T>(p.k, p.k_strides, b, kvh, j0), p.k_strides[2], n_keys, d);
    fill_row(0.0f, dK, L.Bc * d_pad);
    fill_row(0.0f, dV, L.Bc * d_pad);
    for (int64_t g = 0; g < L.part_heads; ++g)
      for (int64_t i0 = 0; i0 < p.q_len; i0 += L.Br)
        tile_pair<T>(bp, L, b, h0 + g, i0, j0, n_keys, k_finite, delta + g * L.q_pad, lse + g * L.q_pad,
                     dQ + g * L.q_pad * d_pad, scratch);
    T* dk_out = static_cast<T*>(bp.dk) + b * bp.dk_strides[0] + kvh * bp.dk_strides[1] + j0 * bp.dk_strides[2];
    T* dv_out = static_cast<T*>(bp.dv) + b * bp.dv_strides[0] + kvh * bp.dv_strides[1] + j0 * bp.dv_strides[2];
    // dk = Σ over the parts, in part order, of scale · (the part's dK_j); dv likewise (float32: heuristics.h splits
    // heads for float32 only, so every partial sum is a float).
    const int64_t turn = L.pairs * L.head_parts + pair * L.Tc + j;
    const bool first = part == 0;
    if (L.head_parts > 1) key_runs::wait_for_turn(ws, turn, part);
    for (int64_t t = 0; t < n_keys; ++t)
      for (int64_t c = 0; c < d; ++c) {
        T& dk = dk_out[t * bp.dk_strides[2] + c];
        T& dv = dv_out[t * bp.dv_strides[2] + c];
        const float dk_share = p.scale * dK[t * d_pad + c], dv_share = dV[t * d_pad + c];
        dk = static_cast<T>(first ? dk_share : to_float(dk) + dk_share);
        dv = static_cast<T>(first ? dv_share : to_float(dv) + dv_share);
      }
    if (L.head_parts > 1) key_runs::end_turn(ws, turn, part);
  }
  if (L.chunks > 1) return merge_chunk(bp, L, b, kvh, chunk, part, dQ, ws);
  for (int64_t g = 0; g < L.part_heads; ++g) {
    T* dq_out = static_cast<T*>(bp.dq) + b * bp.dq_strides[0] + (h0 + g) * bp.dq_strides[1];
    const float* dQg = dQ + g * L.q_pad * d_pad;
    for (int64_t i = 0; i < p.q_len; ++i)
      for (int64_t c = 0; c < d; ++c) dq_out[i * bp.dq_strides[2] + c] = static_cast<T>(p.scale * dQg[i * d_pad + c]);
  }
}

template <class T>
void run(const AttentionBackwardParams& bp, float* ws) {
  const AttentionParams& p = bp.fwd;
  const Layout L(bp);
  const bool in_turns = L.chunks > 1 || L.head_parts > 1;
  if (in_turns) key_runs::reset(ws, L.turns);
#pragma omp parallel num_threads(static_cast<int>(L.threads))
  {
    float* scratch = ws + L.shared + omp_get_thread_num() * L.per_thread;
    fill_row(1.0f, scratch + L.ones_off, std::max(L.Br, L.Bc));  // α = 1: the products accumulate
    // Task t: chunk by chunk, then (batch, kv head), then head part.
    const auto task = [&](int64_t t) {
      const int64_t chunk = t / (L.pairs * L.head_parts), pair = t / L.head_parts % L.pairs;
      const int64_t b = pair / p.num_kv_heads;  // packed sequences: the task reads sequence b as a call of its own
      kv_head_task<T>(sequence_view(bp, b), L, b, pair % p.num_kv_heads, chunk, t % L.head_parts, scratch + L.dq_off,
                      scratch, ws);
    };
    if (!in_turns) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < L.tasks; ++t) task(t);
    } else {
      key_runs::take_in_order(ws, L.tasks, task);
      if (L.chunks > 1) {
#pragma omp barrier
        // Every sum is complete: dQ = scale · sum.
        const int64_t rows = p.batch * p.num_heads * p.q_len;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t b = r / (p.num_heads * p.q_len), h = (r / p.q_len) % p.num_heads, i = r % p.q_len;
          const float* sum = dq_sum_row(bp, L, ws, b, h / L.group_size, h % L.group_size, i);
          T* dq_out = static_cast<T*>(bp.dq) + b * bp.dq_strides[0] + h * bp.dq_strides[1] + i * bp.dq_strides[2];
          for (int64_t e = 0; e < p.head_dim; ++e) dq_out[e] = static_cast<T>(p.scale * sum[e]);  // (in place: float)
        }
      }
    }
  }
}

// Whether this kernel runs these params: heuristics.h asked for it (windows and key ranges are its rows' key ranges,
// visible_key_range; attn_mask is read a tile pair at a time; dropout is Z above).
inline bool applies(const AttentionBackwardParams& bp) { return bp.path == BackwardPath::one_pass; }

inline int64_t workspace_floats(const AttentionBackwardParams& bp) {
  const Layout L(bp);
  return L.shared + L.threads * L.per_thread;
}

inline void run_any(const AttentionBackwardParams& bp, float* ws) {
  switch (bp.fwd.dtype) {
    case DType::f32: run<float>(bp, ws); break;
    case DType::bf16: run<c10::BFloat16>(bp, ws); break;
    case DType::f16: run<c10::Half>(bp, ws); break;
  }
}

}  // namespace flash_backward_onepass
}  // namespace CS149_ISA
}  // namespace cs149gpt
