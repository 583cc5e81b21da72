// Rung 4 — FlashAttention forward (Dao et al., 2022, Algorithm 1), with the online softmax.
//
// Split Q into Tr tiles of Br query rows and K, V into Tc tiles of Bc key rows. For each query tile Q_i:
//   m = −inf, l = 0, O_i = 0                       running row max, running row sum, unnormalised output
//   for each key tile j that the causal mask lets Q_i see:
//     S_ij  = c(scale · Q_i K_jᵀ) + A_ij + M_ij     Br × Bc   (c: softcap; A: ALiBi; M: attn_mask, −inf where masked)
//     m_new = max(m, rowmax(S_ij))
//     P_ij  = exp(S_ij − m_new)                    Br × Bc
//     l     = exp(m − m_new) · l + rowsum(P_ij)
//     O_i   = exp(m − m_new) · O_i + (P_ij ∘ Z_ij) V_j     (Z: dropout's keep mask / (1 − p); 1 without)
//     m     = m_new
//   O_i = O_i / l,   lse_i = m + log(l)
// Every exponent is ≤ 0, so nothing overflows, and rescaling by exp(m − m_new) keeps the result exact.
//
// How it is made fast on a CPU, without changing the algorithm above:
// - Both products, S_ij = Q_i K_jᵀ and P_ij V_j, run through one register-blocked micro-kernel
//   (micro_gemm in simd.h) whose right operand is read a row of vectors at a time. So K is packed once,
//   transposed, tile by tile (K_jᵀ: d × Bc), by all threads together in chunks, each kv head's just before its
//   query tiles (no barrier: run_forward_tiles, flash_common.h), in panels of
//   as many keys as one micro-kernel call covers (d × 32 with AVX-512, contiguous): a call then streams
//   through consecutive cache lines, where rows of the whole tile, 2 KB apart, would all fall into the same
//   few L1 sets. V is read in place, or packed once too when it is not float32 or d is not a whole number
//   of vectors. Where each key tile serves one task only (a head's queries in one tile, no GQA group: short
//   sequences such as BERT's), the task packs its tiles itself, into its own scratch, just before it reads them.
// - Q_i is copied once per tile, pre-multiplied by `scale` · log2(e) (and converted to float32): the logits
//   are then in base 2, exp(x) = 2^(x · log2 e), and the online softmax takes 2^(S − m), which is cheaper
//   than exp (simd.h's exp2); lse goes back to base e at the end.
// - A query tile is processed a row group of G rows at a time (G = kRowGroup, all rows of the
//   micro-kernels): S for G rows stays in L1 while the group goes QKᵀ → online softmax → PV.
// - The row max of S_ij comes out of the product itself: micro_gemm keeps a running maximum of each row's vectors as
//   it stores them (where every row of the group sees every key and no mask is added after the product), so the
//   softmax reads S once (2^(S − m) and its sum), not twice; a row whose maximum is −inf is read again for a NaN.
// - Causal: key tiles beyond a query tile's last visible key are never visited; within a tile a row
//   group stops at its own last visible key; the remaining masked entries are set to −inf.
// - attn_mask: each (row group, key tile) block is classified as it is read (mask_block, flash_common.h): a block
//   it hides whole is skipped, one it leaves whole takes the unmasked path, only the rest add it to S (its
//   offsets times log2 e: S is in base 2).
// - Threads take packing chunks and (batch, head, query tile) tasks dynamically, a head's tiles costliest first.
// - The workspace comes from the caller; nothing is allocated here.
// A query row that sees no key at all (bottom-right causal with q_len > kv_len) gets O = 0, lse = −inf.
// Non-finite values follow the README's rules ("Non-finite values"): a NaN or +inf logit makes its row NaN,
// −inf logits weigh 0, and a key hidden by the mask never touches a row.
#include "../attention.h"
#include "flash_common.h"

#include <algorithm>
#include <type_traits>
#include <omp.h>

namespace cs149gpt {
namespace CS149_ISA {
namespace flash {

// Default tiles (heuristics.h, which has the measurements); without a causal mask or window, wider ones.
constexpr int64_t kDefaultBlockQ = tiles::kFlashRowGroups * kRowGroup, kDefaultBlockK = tiles::kFlashBlockK;
constexpr int64_t kWideBlockQ = tiles::kFlashWideRowGroups * kRowGroup, kWideBlockK = tiles::kFlashWideBlockK;

// Tile sizes and where each piece of the workspace lives. All sizes in floats.
struct Layout {
  int64_t Br, Bc, Tr, Tc;
  int64_t Br_pad, Bc_pad, d_pad;  // rows to whole row groups, keys and columns to whole vectors
  int64_t s_ld;                   // S's row stride: a cache line past Bc_pad (line_past)
  int64_t panel;                  // keys per panel of K_jᵀ (pack_kv_tile)
  bool pack_v;                    // V is converted/padded once rather than read in place
  // Each packed key tile is read by one task only (one query tile a head, no GQA group: BERT's 128 tokens, ViT's
  // 197): the task packs its tiles itself, one at a time, into its thread's scratch, where the tile is then still in
  // cache, instead of into a shared workspace as large as K (and V), by other threads.
  bool pack_in_task;
  int64_t kt_tile;                // floats per packed K_jᵀ tile: d × Bc_pad, to whole panels
  PackChunks pack;                // each tile packed in chunks of whole panels (flash_common.h)
  int64_t kt_size, v_size;        // all packed K tiles; packed V (0 when read in place or packed in the task)
  int64_t v_rows;                 // rows of packed V per (batch, kv head): kv_len (the longest sequence's, varlen)
  int64_t flags_size;             // attn_mask: one flag per chunk of V tile, 1 if it is all finite (else 0 floats)
  int64_t ready_size;             // a counter of packed chunks per (batch, kv head), a cache line each (int64)
  int64_t q_off, s_off, o_off, m_off, l_off, alpha_off, row_max_off, bias_off, kt_off, v_off, per_thread;  // per thread

  explicit Layout(const AttentionParams& p) {
    const int64_t d = p.head_dim;
    const bool wide = !p.is_causal && !has_window(p);
    Br = p.block_q > 0 ? p.block_q : wide ? kWideBlockQ : kDefaultBlockQ;
    Bc = p.block_k > 0 ? p.block_k : wide ? kWideBlockK : kDefaultBlockK;
    if (p.block_q <= 0) {
      // Enough tasks to keep every thread busy: shrink the query tile (never below one row group).
      while (Br > kRowGroup && p.batch * p.num_heads * ((p.q_len + Br - 1) / Br) < 4 * p.num_threads)
        Br -= kRowGroup;
    }
    Br = std::min(Br, p.q_len);
    Bc = std::min(Bc, p.kv_len);
    Tr = (p.q_len + Br - 1) / Br;
    Tc = (p.kv_len + Bc - 1) / Bc;
    Br_pad = round_up(Br, kRowGroup);
    Bc_pad = round_up(Bc, W);
    d_pad = round_up(d, W);
    s_ld = line_past(Bc_pad, sizeof(float));
    panel = std::min<int64_t>(kQkVecs * W, Bc_pad);
    pack_v = p.dtype != DType::f32 || d_pad != d || p.block_table;  // (a paged V is not one strided run)
    pack_in_task = Tr == 1 && p.num_heads == p.num_kv_heads;
    kt_tile = d * round_up(Bc_pad, panel);
    pack = pack_in_task ? PackChunks{kt_tile / d, 1} : split_packing(p, Tc, kt_tile / d, panel);
    kt_size = pack_in_task ? 0 : p.batch * p.num_kv_heads * Tc * kt_tile;
    v_rows = p.kv_len;
    v_size = pack_v && !pack_in_task ? p.batch * p.num_kv_heads * v_rows * d_pad : 0;
    const bool masked = has_mask_or_window(p);
    flags_size = masked && !pack_in_task ? round_up(p.batch * p.num_kv_heads * Tc * pack.chunks, 16) : 0;
    ready_size = pack_in_task ? 0 : p.batch * p.num_kv_heads * kCounterFloats;
    // Per thread: Q_i (Br_pad × d), S for one row group (G × s_ld), O_i (Br_pad × d_pad), m, l, α, the group's
    // running row maxima (G vectors), with attn_mask its offsets for one row group (G × Bc_pad), and when the task
    // packs its own tiles, K_jᵀ and V_j.
    // Each piece starts on a cache line (16 floats) so threads never share one.
    q_off = 0;
    s_off = q_off + round_up(Br_pad * d, 16);
    o_off = s_off + round_up(kRowGroup * s_ld, 16);
    m_off = o_off + round_up(Br_pad * d_pad, 16);
    l_off = m_off + round_up(Br_pad, 16);
    alpha_off = l_off + round_up(Br_pad, 16);
    row_max_off = alpha_off + round_up(2 * kRowGroup, 16);  // α and m_new of one row group
    bias_off = row_max_off + round_up(kRowGroup * W, 16);
    kt_off = bias_off + round_up(masked ? kRowGroup * Bc_pad : 0, 16);
    v_off = kt_off + (pack_in_task ? round_up(kt_tile, 16) : 0);
    per_thread = v_off + (pack_in_task && pack_v ? Bc * d_pad : 0);
  }
};

// Chunk c of key tile j of (batch b, kv head kvh), keys [t0, t1) of the tile (whole panels; L.pack): its panels of
// K_jᵀ into the tile's kt, each d × panel and contiguous:
// kt[(t / panel) · panel · d + col · panel + t % panel] = k[j0 + t][col], zero past the tile's keys;
// its rows of V_j (when packed) into the tile's vp: vp[t * d_pad + col] = v[j0 + t][col], zero in the padding columns.
// Keys are read through kv_row, a run of rows at a time (a paged cache: the rest of a page).
// Returns whether those rows of V_j are all finite (asked only under attn_mask or a window: true otherwise).
template <class T>
bool pack_kv_chunk(const AttentionParams& p, const Layout& L, int64_t b, int64_t kvh, int64_t j, int64_t c, float* kt,
                   float* vp) {
  const int64_t d = p.head_dim, j0 = j * L.Bc, cols = std::min(L.Bc, p.kv_len - j0);
  const int64_t t0 = c * L.pack.keys, t1 = std::min(t0 + L.pack.keys, L.kt_tile / d);
  const int64_t P = L.panel, ldk = p.k_strides[2], ldv = p.v_strides[2];
  for (int64_t t = t0; t < t1; t += P) {
    float* panel = kt + t * d;
    const int64_t keys = std::clamp<int64_t>(cols - t, 0, P);
    if (keys < P) fill_row(0.0f, panel, d * P);
    for (int64_t i = 0, run; i < keys; i += run) {  // keys t + i .. t + i + run − 1 of the tile, ldk apart
      const T* K = kv_row<T>(p, p.k, p.k_strides, b, kvh, j0 + t + i, &run);
      run = std::min(run, keys - i);
      if constexpr (std::is_same_v<T, float>) {  // 16 × 16 blocks through registers (simd.h)
        transpose_block(K, ldk, run, d, 1.0f, panel + i, P);
      } else {
        for (int64_t col = 0; col < d; ++col)
          for (int64_t r = 0; r < run; ++r) panel[col * P + i + r] = to_float(K[r * ldk + col]);
      }
    }
  }
  const int64_t v_end = t0 + std::clamp<int64_t>(cols - t0, 0, t1 - t0);
  bool finite = true;
  for (int64_t t = t0, run; t < v_end; t += run) {
    const T* V = kv_row<T>(p, p.v, p.v_strides, b, kvh, j0 + t, &run);
    run = std::min(run, v_end - t);
    if (L.pack_v)
      for (int64_t r = 0; r < run; ++r) {
        float* row = vp + (t + r) * L.d_pad;
        for (int64_t col = 0; col < d; ++col) row[col] = to_float(V[r * ldv + col]);
        for (int64_t col = d; col < L.d_pad; ++col) row[col] = 0.0f;
      }
    if (has_mask_or_window(p)) finite = finite && rows_finite(V, ldv, run, d);
  }
  return finite;
}

// Where key tile j of a (batch, kv head) lives when every tile is packed up front: its K_jᵀ, its V_j rows (when
// packed) and its chunks' flags.
struct PackedTiles {
  float *kt_all, *v_all, *v_finite;
  bool finite(const Layout& L, int64_t head, int64_t j) const {
    return L.flags_size == 0 || all_chunks_finite(v_finite + (head * L.Tc + j) * L.pack.chunks, L.pack.chunks);
  }
  float* kt(const Layout& L, int64_t head, int64_t j) const { return kt_all + (head * L.Tc + j) * L.kt_tile; }
  float* v(const Layout& L, int64_t head, int64_t j) const {
    return v_all + (head * L.v_rows + j * L.Bc) * L.d_pad;
  }
};

// ALiBi in the softmax's exp pass (FusedLogit) for the rows [g0, g0 + group_rows) of a query tile starting at i0,
// against keys [j0, j0 + n_keys): row r's max is taken as its scores' max plus the largest offset on the keys it
// sees (its key t* nearest the diagonal), an upper bound of its logits' max. Where that bound exceeds the logit at
// t* by more than kAlibiMaxGap (base 2; simd.h), its own largest weight could be dropped with the far keys': such a
// row (and one whose max is NaN or inf) takes ALiBi by the separate pass instead
// (dist0 = kAlibiApplied), as do the padding rows, and every row under a slope that is not >= 0 (a negative one
// raises the far keys' logits: the nearest key's offset bounds nothing). row_max: the scores' maxima from the
// product, or null (then read from S).
inline void alibi_rows(const AttentionParams& p, int64_t g0, int64_t group_rows, int64_t j0, int64_t n_keys,
                       const int64_t* visible, const float* S, int64_t ld, const float* row_max, float slope,
                       int64_t i0, int32_t* dist0, float* bound) {
  for (int64_t r = 0; r < kRowGroup; ++r) {
    dist0[r] = FusedLogit::kAlibiApplied;
    bound[r] = 0.0f;
    if (r >= group_rows || visible[r] == 0 || !(slope >= 0.0f)) continue;
    const float* s = S + r * ld;
    const int64_t dist = i0 + g0 + r + p.kv_len - p.q_len - j0;  // key j0's; key t's is dist − t
    const int64_t nearest = std::clamp<int64_t>(dist, 0, visible[r] - 1);
    const float mx = row_max ? row_max_from_vecs(row_max + r * W, s, n_keys) : max_of(s, visible[r]);
    if (!(mx - s[nearest] <= kAlibiMaxGap)) continue;
    dist0[r] = static_cast<int32_t>(dist);
    bound[r] = -slope * static_cast<float>(std::abs(dist - nearest));
  }
}

// One query tile: rows [i0, i0 + rows) of head h in batch b.
template <class T>
void query_tile(const AttentionParams& p, const Layout& L, int64_t b, int64_t h, int64_t i0,
                const PackedTiles& packed, float* scratch) {
  const int64_t d = p.head_dim, d_pad = L.d_pad, rows = std::min(L.Br, p.q_len - i0);
  const int64_t groups = (rows + kRowGroup - 1) / kRowGroup;
  float *Qi = scratch + L.q_off, *S = scratch + L.s_off, *Oi = scratch + L.o_off;
  float *m = scratch + L.m_off, *l = scratch + L.l_off;
  float *alpha = scratch + L.alpha_off, *m_new = alpha + kRowGroup;  // per row of the current group
  float* bias = scratch + L.bias_off;  // attn_mask's offsets for the current group and key tile
  float* row_max = scratch + L.row_max_off;  // the group's row maxima of S, a vector a row, as the product takes them
  int64_t visible[kRowGroup];  // how many keys of the current tile each row of the group sees
  int32_t alibi_dist0[kRowGroup];  // ALiBi in the exp pass: each row's key 0 distance, and its largest offset
  float alibi_bound[kRowGroup];

  // Q_i = scale · log2(e) · Q[i0 : i0 + rows] (logits in base 2), zero rows up to whole row groups;
  // m = −inf, l = 0, O_i = 0. Each row group is stored column by column (element (r, c) of the group at
  // c · kRowGroup + r): the micro-kernel of S = Q_g K_jᵀ broadcasts the group's rows at one step of c from one
  // pointer and constant offsets, where rows kept apart would take a register each for their addresses (24 rows:
  // more than x86-64 has, and the compiler spilled them inside the loop).
  constexpr float kLog2e = 1.44269504088896341f;
  const float q_scale = p.scale * kLog2e;
  const T* Q = q_head<T>(p, b, h) + i0 * p.q_strides[2];
  if constexpr (std::is_same_v<T, float>) {  // a group's rows become its columns: 16 × 16 blocks (simd.h)
    for (int64_t g0 = 0; g0 < groups * kRowGroup; g0 += kRowGroup) {
      const int64_t group_rows = std::min<int64_t>(kRowGroup, rows - g0);
      if (group_rows < kRowGroup) fill_row(0.0f, Qi + g0 * d, kRowGroup * d);
      transpose_block(Q + g0 * p.q_strides[2], p.q_strides[2], group_rows, d, q_scale, Qi + g0 * d, kRowGroup);
    }
  } else {
    for (int64_t r = 0; r < groups * kRowGroup; ++r) {
      float* column_major = Qi + (r / kRowGroup) * kRowGroup * d + r % kRowGroup;
      for (int64_t c = 0; c < d; ++c)
        column_major[c * kRowGroup] = r < rows ? q_scale * to_float(Q[r * p.q_strides[2] + c]) : 0.0f;
    }
  }
  fill_row(kNegInf, m, groups * kRowGroup);
  fill_row(0.0f, l, groups * kRowGroup);
  fill_row(0.0f, Oi, groups * kRowGroup * d_pad);

  const int64_t kvh = kv_head(p, h), head = b * p.num_kv_heads + kvh;
  const T* V_in_place = v_head<T>(p, b, h);
  const int64_t ldv = L.pack_v ? d_pad : p.v_strides[2];

  const LogitMods mods(p, kLog2e);
  const int64_t keys_seen = visible_keys(p, i0 + rows - 1);  // by the tile's last row, which sees most
  for (int64_t j0 = 0, j = 0; j0 < keys_seen; j0 += L.Bc, ++j) {
    const int64_t cols = std::min(L.Bc, p.kv_len - j0);
    const float *KTj, *Vj = nullptr;
    if (!L.pack_v) Vj = reinterpret_cast<const float*>(V_in_place) + j0 * p.v_strides[2];  // float32, in place
    bool v_finite;
    if (L.pack_in_task) {
      v_finite = pack_kv_chunk<T>(p, L, b, kvh, j, 0, scratch + L.kt_off, scratch + L.v_off);  // the whole tile
      KTj = scratch + L.kt_off;
      if (L.pack_v) Vj = scratch + L.v_off;
    } else {
      KTj = packed.kt(L, head, j);
      if (L.pack_v) Vj = packed.v(L, head, j);
      v_finite = packed.finite(L, head, j);
    }

    for (int64_t g0 = 0; g0 < rows; g0 += kRowGroup) {
      // Keys of this tile that the group's last row sees; the group's other rows see a prefix of them.
      const int64_t group_last = i0 + std::min(g0 + kRowGroup, rows) - 1;
      int64_t n_keys = std::clamp<int64_t>(visible_keys(p, group_last) - j0, 0, cols);
      if (n_keys == 0) continue;
      const int64_t group_rows = std::min<int64_t>(kRowGroup, rows - g0);
      // attn_mask: a block it hides whole is skipped, one it leaves whole takes the unmasked path, one it cuts
      // stops at the last key it shows. The next block's entries are asked for first (the next row group, else
      // the next key tile's first), to arrive while this one is computed. Key ranges stop the block at the last
      // key any row shows first (window_keys_end).
      n_keys = window_keys_end(p, b, h, i0 + g0, group_rows, j0, n_keys);
      if (n_keys == 0) continue;
      prefetch_next_mask_block(p, b, h, i0, rows, g0, kRowGroup, j0, L.Bc);
      // (Straight from the mask where it can be, flash_common.h; not where V_j holds a NaN or inf: below, the rows
      // that add V_j one key at a time read the offsets.)
      const bool direct = mask_rows_direct(p) && v_finite;
      const MaskBlock block = direct ? classify_mask_block(p, b, h, i0 + g0, group_rows, j0, n_keys)
                                     : mask_block(p, b, h, i0 + g0, group_rows, j0, n_keys, bias, L.Bc_pad, 1);
      if (block == MaskBlock::hidden) continue;
      if (block == MaskBlock::partial)
        n_keys = direct ? shown_keys_end_direct(p, b, h, i0 + g0, group_rows, j0, n_keys)
                        : shown_keys_end(bias, L.Bc_pad, group_rows, n_keys);

      for (int64_t r = 0; r < kRowGroup; ++r)
        visible[r] = std::clamp<int64_t>(visible_keys(p, i0 + g0 + r) - j0, 0, n_keys);
      // S = Q_g K_jᵀ   (G × n_keys, computed to a whole number of vectors);  S = S + mask where it cuts the block.
      // Where every row sees every key and no mask is added, the product also takes the rows' maxima from its
      // registers, so that the softmax does not read S once more for them.
      // softcap alone or ALiBi alone, where no mask follows, ride in the softmax's exp pass (fused); otherwise a pass
      // of their own applies them and takes the maxima (on the keys each row sees; rows past group_rows are
      // padding, never read).
      const bool unmasked = block != MaskBlock::partial;
      const bool fused_alibi = mods.fused_alibi && unmasked;
      const bool fused = (mods.fused_softcap || mods.fused_alibi) && unmasked, mods_pass = mods.any && !fused;
      const bool max_in_product = unmasked && visible[0] == n_keys && !mods_pass;
      const bool max_in_mods = unmasked && mods_pass;
      if (max_in_product || max_in_mods) fill_row(kNegInf, row_max, kRowGroup * W);
      group_gemm_panels<kQkVecs, /*kRowsAdjacent=*/true>(kRowGroup, d, Qi + g0 * d, 1, kRowGroup, KTj, L.panel,
                                                         round_up(n_keys, W), S, L.s_ld,
                                                         max_in_product ? row_max : nullptr, n_keys);
      // softcap, ALiBi (base 2: cap and slopes times log2 e), before attn_mask.
      if (mods_pass)
        for (int64_t r = 0; r < group_rows; ++r)
          mods.row(p, b, h, i0 + g0 + r, j0, S + r * L.s_ld, visible[r], 1.0f, nullptr,
                   max_in_mods ? row_max + r * W : nullptr);
      FusedLogit logit;
      if (fused && mods.fused_softcap) logit.cap = mods.cap;
      if (fused_alibi) {
        logit.slope = mods.slope(p, b, h);
        alibi_rows(p, g0, group_rows, j0, n_keys, visible, S, L.s_ld, max_in_product ? row_max : nullptr, logit.slope,
                   i0, alibi_dist0, alibi_bound);
        for (int64_t r = 0; r < group_rows; ++r)
          if (alibi_dist0[r] == FusedLogit::kAlibiApplied) {  // its maximum taken anew
            if (max_in_product) fill_row(kNegInf, row_max + r * W, W);
            mods.row(p, b, h, i0 + g0 + r, j0, S + r * L.s_ld, visible[r], 1.0f, nullptr,
                     max_in_product ? row_max + r * W : nullptr);
          }
        logit.dist0 = alibi_dist0;
        logit.bound = alibi_bound;
      }
      if (block == MaskBlock::partial)
        for (int64_t r = 0; r < group_rows; ++r) {
          if (direct)
            add_mask_row(p, b, h, i0 + g0 + r, j0, S + r * L.s_ld, n_keys, kLog2e);
          else
            add_mask(S + r * L.s_ld, bias + r * L.Bc_pad, n_keys, kLog2e);
        }

      // Online softmax for the group's rows: S becomes P, and m, l, α are updated (flash_common.h).
      online_softmax(S, L.s_ld, kRowGroup, n_keys, visible, /*scale=*/1.0f, m + g0, l + g0, alpha, m_new,
                     PInPlaceBase2{logit}, max_in_product || max_in_mods ? row_max : nullptr);
      if (p.dropout_p > 0.0f)  // P V with the dropped P; l (and lse) keep the undropped sum
        for (int64_t r = 0; r < group_rows; ++r) dropout_row(p, b * p.num_heads + h, i0 + g0 + r, j0, S + r * L.s_ld, visible[r], 1);

      if (block == MaskBlock::partial && !v_finite) {
        // A NaN or inf in V_j: each row adds only the keys it sees, since P = 0 at a hidden key would still
        // multiply its NaN (README, "Non-finite values").
        for (int64_t r = 0; r < group_rows; ++r) {
          float* o = Oi + (g0 + r) * d_pad;
          scale_row(alpha[r], o, d_pad);
          for (int64_t t = 0; t < visible[r]; ++t)
            if (bias[r * L.Bc_pad + t] != kNegInf) axpy(S[r * L.s_ld + t], Vj + t * ldv, o, d);
        }
        continue;
      }

      // O_g = α · O_g + P V_j. The keys that every row of the group sees (all of them, but for the causal
      // diagonal) go through the micro-kernel; the few that only the later rows see are added row by row,
      // so that a key hidden from a row never touches it: its P is 0, but 0 · NaN in V would be NaN.
      const int64_t shared_keys = visible[0];
      group_gemm<kPvVecs>(kRowGroup, shared_keys, S, L.s_ld, 1, Vj, ldv, d_pad, Oi + g0 * d_pad, d_pad, alpha);
      for (int64_t r = 0; r < kRowGroup && g0 + r < rows; ++r)
        if (visible[r] > shared_keys)
          weighted_row_sum</*kAccumulate=*/true>(S + r * L.s_ld + shared_keys, Vj + shared_keys * ldv, ldv,
                                                 visible[r] - shared_keys, Oi + (g0 + r) * d_pad, d_pad);
    }
  }

  finish_rows<T>(p, b, h, i0, rows, Oi, d_pad, m, l, /*base2=*/true);
}

template <class T>
void run(const AttentionParams& p, float* workspace) {
  const Layout L(p);
  PackedTiles packed;
  int64_t* ready = reinterpret_cast<int64_t*>(workspace);  // first: the workspace's start is 64-byte aligned
  packed.kt_all = workspace + L.ready_size;
  packed.v_all = packed.kt_all + L.kt_size;
  packed.v_finite = packed.v_all + L.v_size;
  float* thread_scratch = packed.v_finite + L.flags_size;
  // Every K tile (and V) packed once, chunk by chunk, by whichever threads come (unless each task packs its own),
  // beside the query tiles of the kv heads before; the query tiles costliest first (flash_common.h).
  run_forward_tiles(
      p, L.Br, L.Tr, L.pack_in_task ? 0 : L.Tc * L.pack.chunks, ready, thread_scratch, L.per_thread,
      [&](int64_t b, int64_t kvh, int64_t u) {
        const AttentionParams seq = sequence_view(p, b);  // packed sequences: b's own keys (p itself otherwise)
        const int64_t head = b * p.num_kv_heads + kvh, j = u / L.pack.chunks, c = u % L.pack.chunks;
        if (j * L.Bc >= seq.kv_len) return;  // past a shorter sequence's keys: never read
        const bool v_finite = pack_kv_chunk<T>(seq, L, b, kvh, j, c, packed.kt(L, head, j),
                                               L.pack_v ? packed.v(L, head, j) : nullptr);
        if (L.flags_size > 0) packed.v_finite[head * L.Tc * L.pack.chunks + u] = v_finite ? 1.0f : 0.0f;
      },
      [&](int64_t b, int64_t h, int64_t i0, float* scratch) {
        const AttentionParams seq = sequence_view(p, b);
        if (i0 < seq.q_len) query_tile<T>(seq, L, b, h, i0, packed, scratch);
      });
}

}  // namespace flash

// A handful of query rows (decoding with a KV cache) go to flash-decoding (flash_decode.cpp), which splits
// the keys across threads instead of the queries.
int64_t flash_workspace_floats(const AttentionParams& p) {
  if (flash_decode::applies(p)) return flash_decode::workspace_floats(p);
#if defined(CS149_ISA_BF16_DOT)
  if (p.dtype == DType::bf16) return flash_bf16::workspace_floats(p);
#endif
#if defined(CS149_ISA_SPLIT_ON_TILES)
  if (p.dtype == DType::f16 || flash_bf16::takes_float32(p)) return flash_bf16::workspace_floats(p);
#endif
  const flash::Layout L(p);
  return L.kt_size + L.v_size + L.flags_size + L.ready_size + p.num_threads * L.per_thread;
}

template <class T>
void flash_dispatch(const AttentionParams& p, float* workspace) {
  if (flash_decode::applies(p))
    flash_decode::run<T>(p, workspace);
  else
    flash::run<T>(p, workspace);
}

void flash_attention(const AttentionParams& p, float* workspace) {
  switch (p.dtype) {
    case DType::f32:
#if defined(CS149_ISA_SPLIT_ON_TILES)  // AMX tiles when asked: three bf16 parts, twelve tile products
      if (!flash_decode::applies(p) && flash_bf16::takes_float32(p)) return flash_bf16::run<float>(p, workspace);
#endif
      flash_dispatch<float>(p, workspace);
      break;
    case DType::bf16:
#if defined(CS149_ISA_BF16_DOT)  // bf16 dot-product hardware: both products on bf16 operands (flash_bf16.cpp)
      if (!flash_decode::applies(p)) return flash_bf16::run<c10::BFloat16>(p, workspace);
#endif
      flash_dispatch<c10::BFloat16>(p, workspace);
      break;
    case DType::f16:
#if defined(CS149_ISA_SPLIT_ON_TILES)  // AMX tiles: each operand as two bf16 parts, seven tile products (flash_bf16.cpp)
      if (!flash_decode::applies(p)) return flash_bf16::run<c10::Half>(p, workspace);
#endif
      flash_dispatch<c10::Half>(p, workspace);
      break;
  }
}

}  // namespace CS149_ISA
}  // namespace cs149gpt
