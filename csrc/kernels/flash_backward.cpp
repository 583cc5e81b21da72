// FlashAttention-2 backward (Dao, 2023, Algorithm 2), recomputing P tile by tile from the saved lse.
//
// With S = c(scale · Q Kᵀ) + ALiBi (masked; c the softcap, c(x) = cap · tanh(x / cap), else x), P = exp(S − lse) (the
// forward's softmax, never stored) and dO = ∂L/∂O:
//   D   = rowsum(dO ∘ O)                 one number per query row
//   dV  = (P ∘ Z)ᵀ dO                     Z: dropout's keep mask / (1 − p), regenerated (1 without dropout)
//   dP  = (dO Vᵀ) ∘ Z
//   dS  = P ∘ (dP − D) ∘ c'               the softmax's Jacobian row by row; c' = 1 − tanh² (1 without softcap)
//   dQ  = scale · dS K
//   dK  = scale · dSᵀ Q
// All in O(N) memory: P, dP and dS exist one row group × one key tile at a time. attn_mask enters S as in the
// forward (mask_block, flash_common.h): blocks it hides whole are skipped in both passes.
//
// Threads must never write the same rows of dQ, dK or dV, so the work is split in two passes that
// recompute the small tiles of S and dP instead of sharing accumulators:
//   pass 1, one task per (batch, kv head, key tile j): dK_j and dV_j over every query row of every query
//           head of the group (GQA: the group's heads are summed here, no atomics);
//   pass 2, one task per (batch, head, query tile i): dQ_i over every key tile.
// Pass 1 works on the transposed tiles — Sᵀ = K_j Qᵀ, dPᵀ = V_j dOᵀ, keys as rows — so that its products
// dV_j += Pᵀ dO and dK_j += dSᵀ Q run along a long chunk of query rows, and lse and D come as vectors.
// Before the passes, all threads pack the operands once: per query row Q·scale, dO, D, lse, and Qᵀ, dOᵀ;
// per key tile K and V by rows and Kᵀ, Vᵀ. Every product goes through the forward's micro-kernel
// (flash_common.h).
#include "flash_common.h"

#include <algorithm>
#include <numeric>
#include <omp.h>

namespace cs149gpt {
namespace CS149_ISA {
namespace flash_backward {

using namespace flash;

// Key tiles: multiples of kKeyAlign (flash_common.h).
constexpr int64_t kDefaultBlockQ = tiles::kBackwardRowGroups * kRowGroup;  // heuristics.h
constexpr int64_t kDefaultBlockK = tiles::kBackwardRowGroups * kRowGroup;
constexpr int64_t kQueryChunk = 2 * kKeyAlign;  // query rows per step of pass 1

struct Layout {
  int64_t Br, Bc, Tr, Tc, q_pad, k_pad, d_pad;
  // shared, packed once: Q·scale and dO by rows (q_pad × d_pad per head) and transposed (d × q_pad), D and
  // lse (q_pad per head); Kᵀ and Vᵀ tiles (d × Bc each); K and V by rows (k_pad × d_pad per kv head)
  // and with attn_mask or a window, per key tile, whether its K is all finite (1.0f) or not (0.0f)
  int64_t qs_off, do_off, qt_off, dot_off, delta_off, lse_off, kt_off, vt_off, kr_off, vr_off, k_finite_off, shared;
  // per thread: S/P and dP/dS for one row group × one key tile (pass 2) or one key tile × one chunk of
  // kQueryChunk query rows (pass 1, transposed); dK_j, dV_j; dQ for one row group; a row of ones; attn_mask's
  // offsets and softcap's derivative 1 − tanh², laid out like S
  int64_t s_off, ds_off, dk_off, dv_off, dq_off, ones_off, bias_off, grad_off, per_thread;

  explicit Layout(const AttentionBackwardParams& bp) {
    const AttentionParams& p = bp.fwd;
    const int64_t threads_wanted = 4 * p.num_threads;
    // A caller's tile is clamped to the sequence before it is rounded up (so round_up cannot overflow).
    Br = p.block_q > 0 ? round_up(std::min(p.block_q, p.q_len), kRowGroup) : kDefaultBlockQ;
    Bc = p.block_k > 0 ? round_up(std::min(p.block_k, p.kv_len), kKeyAlign) : round_up(kDefaultBlockK, kKeyAlign);
    if (p.block_q <= 0)
      while (Br > kRowGroup && p.batch * p.num_heads * ((p.q_len + Br - 1) / Br) < threads_wanted) Br -= kRowGroup;
    if (p.block_k <= 0)
      while (Bc > kKeyAlign && p.batch * p.num_kv_heads * ((p.kv_len + Bc - 1) / Bc) < threads_wanted) Bc -= kKeyAlign;
    Br = std::min(Br, round_up(p.q_len, kRowGroup));
    Bc = std::min(Bc, round_up(p.kv_len, kKeyAlign));
    Tr = (p.q_len + Br - 1) / Br;
    Tc = (p.kv_len + Bc - 1) / Bc;
    q_pad = round_up(p.q_len, kKeyAlign);  // whole row groups (pass 2) and whole vectors (pass 1)
    k_pad = Tc * Bc;
    d_pad = round_up(p.head_dim, W);
    const int64_t q_heads = p.batch * p.num_heads, kv_heads = p.batch * p.num_kv_heads;
    qs_off = 0;
    do_off = qs_off + q_heads * q_pad * d_pad;
    qt_off = do_off + q_heads * q_pad * d_pad;
    dot_off = qt_off + q_heads * p.head_dim * q_pad;
    delta_off = dot_off + q_heads * p.head_dim * q_pad;
    lse_off = delta_off + q_heads * q_pad;
    kt_off = lse_off + q_heads * q_pad;
    vt_off = kt_off + kv_heads * Tc * p.head_dim * Bc;
    kr_off = vt_off + kv_heads * Tc * p.head_dim * Bc;
    vr_off = kr_off + kv_heads * k_pad * d_pad;
    k_finite_off = vr_off + kv_heads * k_pad * d_pad;
    shared = round_up(k_finite_off + (has_mask_or_window(p) ? kv_heads * Tc : 0), 16);
    const int64_t tile = std::max(kRowGroup * Bc, Bc * kQueryChunk);
    s_off = 0;
    ds_off = s_off + tile;
    dk_off = ds_off + tile;
    dv_off = dk_off + Bc * d_pad;
    dq_off = dv_off + Bc * d_pad;
    ones_off = dq_off + kRowGroup * d_pad;
    bias_off = round_up(ones_off + std::max<int64_t>(Bc, kRowGroup), 16);
    grad_off = bias_off + (has_mask_or_window(p) ? round_up(tile, 16) : 0);  // attn_mask's offsets of a tile
    per_thread = grad_off + (p.softcap > 0.0f ? round_up(tile, 16) : 0);  // softcap's 1 − tanh² of a tile
  }
};

// Packs query row i of head h: Q·scale and dO padded to d_pad columns, D = Σ dO ∘ O, lse (0 past q_len,
// where Q and dO are 0 too, so padding rows contribute nothing).
template <class T>
void pack_query_row(const AttentionBackwardParams& bp, const Layout& L, float* ws, int64_t b, int64_t h, int64_t i) {
  const AttentionParams& p = bp.fwd;
  const int64_t d = p.head_dim, head = b * p.num_heads + h;
  float* qs = ws + L.qs_off + (head * L.q_pad + i) * L.d_pad;
  float* dO = ws + L.do_off + (head * L.q_pad + i) * L.d_pad;
  float* qt = ws + L.qt_off + head * d * L.q_pad + i;   // column i of Qᵀ, rows q_pad apart
  float* dot = ws + L.dot_off + head * d * L.q_pad + i;
  fill_row(0.0f, qs, L.d_pad);
  fill_row(0.0f, dO, L.d_pad);
  float delta = 0.0f, lse = 0.0f;
  if (i < p.q_len) {
    const T* q = q_head<T>(p, b, h) + i * p.q_strides[2];
    const T* o = out_head<T>(p, b, h) + i * p.out_strides[2];
    const T* g = static_cast<const T*>(bp.dout) + b * bp.dout_strides[0] + h * bp.dout_strides[1] + i * bp.dout_strides[2];
    for (int64_t c = 0; c < d; ++c) {
      qs[c] = p.scale * to_float(q[c]);
      dO[c] = to_float(g[c]);
      delta += dO[c] * to_float(o[c]);
    }
    lse = p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i];
    // A row whose logits all weigh 0 (lse = −inf) has P = 0, but exp(S − lse) = exp(−inf + inf) is NaN:
    // with +inf in its place, exp(−inf − inf) = 0. (A NaN lse, from a NaN row, stays NaN and so do its P.)
    if (lse == kNegInf) lse = std::numeric_limits<float>::infinity();
  }
  for (int64_t c = 0; c < d; ++c) {
    qt[c * L.q_pad] = qs[c];
    dot[c * L.q_pad] = dO[c];
  }
  ws[L.delta_off + head * L.q_pad + i] = delta;
  ws[L.lse_off + head * L.q_pad + i] = lse;
}

// Packs key tile j of kv head kvh: Kᵀ and Vᵀ (d × Bc, zero past the keys), K and V rows (Bc × d_pad).
template <class T>
void pack_key_tile(const AttentionBackwardParams& bp, const Layout& L, float* ws, int64_t b, int64_t kvh, int64_t j) {
  const AttentionParams& p = bp.fwd;
  const int64_t d = p.head_dim, head = b * p.num_kv_heads + kvh, j0 = j * L.Bc;
  const int64_t cols = std::max<int64_t>(0, std::min(L.Bc, p.kv_len - j0));
  const T* K = static_cast<const T*>(p.k) + b * p.k_strides[0] + kvh * p.k_strides[1] + j0 * p.k_strides[2];
  const T* V = static_cast<const T*>(p.v) + b * p.v_strides[0] + kvh * p.v_strides[1] + j0 * p.v_strides[2];
  float* kt = ws + L.kt_off + (head * L.Tc + j) * d * L.Bc;
  float* vt = ws + L.vt_off + (head * L.Tc + j) * d * L.Bc;
  float* kr = ws + L.kr_off + (head * L.k_pad + j0) * L.d_pad;
  float* vr = ws + L.vr_off + (head * L.k_pad + j0) * L.d_pad;
  fill_row(0.0f, kt, d * L.Bc);
  fill_row(0.0f, vt, d * L.Bc);
  fill_row(0.0f, kr, L.Bc * L.d_pad);
  fill_row(0.0f, vr, L.Bc * L.d_pad);
  for (int64_t t = 0; t < cols; ++t)
    for (int64_t c = 0; c < d; ++c) {
      const float k_tc = to_float(K[t * p.k_strides[2] + c]), v_tc = to_float(V[t * p.v_strides[2] + c]);
      kt[c * L.Bc + t] = kr[t * L.d_pad + c] = k_tc;
      vt[c * L.Bc + t] = vr[t * L.d_pad + c] = v_tc;
    }
  if (has_mask_or_window(p)) ws[L.k_finite_off + head * L.Tc + j] = rows_finite(K, p.k_strides[2], cols, d) ? 1.0f : 0.0f;
}

// For the row group of query rows [i0, i0 + G) of head h against keys [j0, j0 + n_cols) (n_cols whole
// vectors, row groups; keys past n_keys, or hidden by the mask, get P = dS = 0):
//   S = Q_g K_jᵀ (+ attn_mask's offsets `bias`, rows L.Bc apart, unless null), P = exp(S − lse) into `P`;
//   dP = dO_g V_jᵀ, dS = P ∘ (dP − D) into `dS`.
void recompute_p_and_ds(const AttentionParams& p, const Layout& L, const float* ws, int64_t head, int64_t kv_tile,
                        int64_t i0, int64_t j0, int64_t n_keys, int64_t n_cols, const float* bias, float* P,
                        float* dS, float* grad) {
  const LogitMods mods(p, 1.0f);
  const int64_t b = head / p.num_heads, h = head % p.num_heads;
  const int64_t d = p.head_dim;
  const float* Qg = ws + L.qs_off + (head * L.q_pad + i0) * L.d_pad;
  const float* dOg = ws + L.do_off + (head * L.q_pad + i0) * L.d_pad;
  const float* KTj = ws + L.kt_off + kv_tile * d * L.Bc;
  const float* VTj = ws + L.vt_off + kv_tile * d * L.Bc;
  group_gemm<kQkVecs>(kRowGroup, d, Qg, L.d_pad, 1, KTj, L.Bc, n_cols, P, L.Bc, nullptr);
  group_gemm<kQkVecs>(kRowGroup, d, dOg, L.d_pad, 1, VTj, L.Bc, n_cols, dS, L.Bc, nullptr);
  const float* lse = ws + L.lse_off + head * L.q_pad + i0;
  const float* delta = ws + L.delta_off + head * L.q_pad + i0;
  for (int64_t r = 0; r < kRowGroup; ++r) {
    float* pr = P + r * L.Bc;
    float* dsr = dS + r * L.Bc;
    const int64_t visible = std::clamp<int64_t>(visible_keys(p, i0 + r) - j0, 0, n_keys);
    const bool masked_row = bias && i0 + r < p.q_len;
    float* gr = p.softcap > 0.0f ? grad + r * L.Bc : nullptr;
    if (mods.any && i0 + r < p.q_len) mods.row(p, b, h, i0 + r, j0, pr, visible, 1.0f, gr);  // softcap, ALiBi
    if (masked_row) add_mask(pr, bias + r * L.Bc, visible);
    exp_shifted_sum(pr, lse[r], visible);  // P = exp(S − lse)
    fill_row(0.0f, pr + visible, n_cols - visible);
    if (p.dropout_p > 0.0f && i0 + r < p.q_len) dropout_row(p, head, i0 + r, j0, dsr, visible, 1);  // dP ∘ Z
    const Vec D = Vec::broadcast(delta[r]);
    for (int64_t c = 0; c < n_cols; c += W) (Vec::load(pr + c) * (Vec::load(dsr + c) - D)).store(dsr + c);
    if (gr && i0 + r < p.q_len) times_softcap_grad(dsr, gr, visible);  // dS through the softcap
    fill_row(0.0f, dsr + visible, n_cols - visible);  // hidden keys: dS = 0 even where dP (0 · NaN) is NaN
    if (masked_row) zero_where_hidden(dsr, bias + r * L.Bc, visible);
  }
}

// Pass 1: dK_j, dV_j for key tile j of kv head kvh, summed over the query heads of its group. Transposed:
// for a chunk of query rows [c0, c0 + n_q),
//   Sᵀ = K_j (scale·Q)ᵀ,  Pᵀ = exp(Sᵀ − lse),  dPᵀ = V_j dOᵀ,  dSᵀ = Pᵀ ∘ (dPᵀ − D)   (Bc × n_q; lse, D per column)
//   dV_j += Pᵀ dO,  dK_j += dSᵀ (scale·Q)                                             (long k loop: n_q)
template <class T>
void key_tile(const AttentionBackwardParams& bp, const Layout& L, const float* ws, int64_t b, int64_t kvh, int64_t j,
              float* scratch) {
  const AttentionParams& p = bp.fwd;
  const int64_t d = p.head_dim, d_pad = L.d_pad, j0 = j * L.Bc, cols = std::min(L.Bc, p.kv_len - j0);
  float *PT = scratch + L.s_off, *dST = scratch + L.ds_off, *dK = scratch + L.dk_off, *dV = scratch + L.dv_off;
  float* bias = scratch + L.bias_off;  // attn_mask's offsets, transposed like PT
  float* grad = p.softcap > 0.0f ? scratch + L.grad_off : nullptr;  // softcap's 1 − tanh², transposed like PT
  const LogitMods mods(p, 1.0f);
  const float* ones = scratch + L.ones_off;
  fill_row(0.0f, dK, L.Bc * d_pad);
  fill_row(0.0f, dV, L.Bc * d_pad);
  const int64_t group_size = p.num_heads / p.num_kv_heads, kv = b * p.num_kv_heads + kvh;
  const float* Kj = ws + L.kr_off + (kv * L.k_pad + j0) * d_pad;
  const float* Vj = ws + L.vr_off + (kv * L.k_pad + j0) * d_pad;
  const int64_t rows = round_up(cols, kRowGroup);  // key rows computed (padding keys are zero)

  // Query rows before first_row see no key of this tile (causal); chunks start on whole vectors.
  const int64_t first_row = p.is_causal ? std::clamp<int64_t>(j0 - p.causal_offset, 0, p.q_len) : 0;
  for (int64_t h = kvh * group_size; h < (kvh + 1) * group_size; ++h) {
    const int64_t head = b * p.num_heads + h;
    const float* lse = ws + L.lse_off + head * L.q_pad;
    const float* delta = ws + L.delta_off + head * L.q_pad;
    for (int64_t c0 = first_row / W * W; c0 < p.q_len; c0 += kQueryChunk) {
      const int64_t n_q = std::min(kQueryChunk, L.q_pad - c0);  // whole vectors: q_pad is
      const int64_t real_q = std::min(n_q, p.q_len - c0);       // the rest is padding
      // attn_mask: skip a block it hides whole; add it where it cuts one (bias[t · kQueryChunk + c]).
      const MaskBlock block = mask_block(p, b, h, c0, real_q, j0, cols, bias, 1, kQueryChunk);
      if (block == MaskBlock::hidden) continue;
      const bool partial = block == MaskBlock::partial;
      const float* QT = ws + L.qt_off + head * d * L.q_pad + c0;
      const float* dOT = ws + L.dot_off + head * d * L.q_pad + c0;
      group_gemm<kQkVecs>(rows, d, Kj, d_pad, 1, QT, L.q_pad, n_q, PT, kQueryChunk, nullptr);
      group_gemm<kQkVecs>(rows, d, Vj, d_pad, 1, dOT, L.q_pad, n_q, dST, kQueryChunk, nullptr);
      if (mods.any)  // softcap, ALiBi, key by key (a column of queries each)
        for (int64_t t = 0; t < cols; ++t)
          mods.column(p, b, h, c0, j0 + t, PT + t * kQueryChunk, real_q, 1.0f, grad ? grad + t * kQueryChunk : nullptr);
      if (partial)
        for (int64_t t = 0; t < cols; ++t) add_mask(PT + t * kQueryChunk, bias + t * kQueryChunk, real_q);
      if (p.dropout_p > 0.0f)  // dPᵀ ∘ Zᵀ, column by column (a query row's keys are kQueryChunk apart)
        for (int64_t c = 0; c < real_q; ++c) dropout_row(p, head, c0 + c, j0, dST + c, cols, kQueryChunk);
      for (int64_t t = 0; t < rows; ++t) {
        float* pt = PT + t * kQueryChunk;
        float* dst = dST + t * kQueryChunk;
        // Key j0 + t is visible to query i when i >= j0 + t − causal_offset: a prefix of the chunk is masked.
        const int64_t masked = t >= cols ? n_q
                               : p.is_causal ? std::clamp<int64_t>(j0 + t - p.causal_offset - c0, 0, n_q) : 0;
        const int64_t start = masked / W * W;
        for (int64_t c = start; c < n_q; c += W) {
          const Vec P = exp(Vec::load(pt + c) - Vec::load(lse + c0 + c));
          const Vec dS = P * (Vec::load(dst + c) - Vec::load(delta + c0 + c));
          P.store(pt + c);
          dS.store(dst + c);
        }
        if (grad && t < cols && masked < real_q)  // dS through the softcap
          times_softcap_grad(dst + masked, grad + t * kQueryChunk + masked, real_q - masked);
        fill_row(0.0f, pt, masked);
        fill_row(0.0f, dst, masked);
        // Padding query rows (past q_len) are zero, but 0 · inf in K_j would make their P NaN.
        fill_row(0.0f, pt + real_q, n_q - real_q);
        fill_row(0.0f, dst + real_q, n_q - real_q);
        if (partial && t < cols) zero_where_hidden(dst, bias + t * kQueryChunk, real_q);
      }
      if (p.dropout_p > 0.0f)  // dV_j += (P ∘ Z)ᵀ dO: the forward's dropped P
        for (int64_t c = 0; c < real_q; ++c) dropout_row(p, head, c0 + c, j0, PT + c, cols, kQueryChunk);
      const float* dOc = ws + L.do_off + (head * L.q_pad + c0) * d_pad;
      const float* Qc = ws + L.qs_off + (head * L.q_pad + c0) * d_pad;
      group_gemm<kPvVecs>(rows, n_q, PT, kQueryChunk, 1, dOc, d_pad, d_pad, dV, d_pad, ones);
      group_gemm<kPvVecs>(rows, n_q, dST, kQueryChunk, 1, Qc, d_pad, d_pad, dK, d_pad, ones);
    }
  }

  T* dk_out = static_cast<T*>(bp.dk) + b * bp.dk_strides[0] + kvh * bp.dk_strides[1] + j0 * bp.dk_strides[2];
  T* dv_out = static_cast<T*>(bp.dv) + b * bp.dv_strides[0] + kvh * bp.dv_strides[1] + j0 * bp.dv_strides[2];
  for (int64_t t = 0; t < cols; ++t)
    for (int64_t c = 0; c < d; ++c) {
      dk_out[t * bp.dk_strides[2] + c] = static_cast<T>(dK[t * d_pad + c]);
      dv_out[t * bp.dv_strides[2] + c] = static_cast<T>(dV[t * d_pad + c]);
    }
}

// Pass 2: dQ for query tile [i_begin, i_end) of head h, a row group at a time, over every visible key tile.
template <class T>
void query_tile(const AttentionBackwardParams& bp, const Layout& L, const float* ws, int64_t b, int64_t h,
                int64_t i_begin, int64_t i_end, float* scratch) {
  const AttentionParams& p = bp.fwd;
  const int64_t d = p.head_dim, d_pad = L.d_pad, head = b * p.num_heads + h, kvh = kv_head(p, h);
  float *P = scratch + L.s_off, *dS = scratch + L.ds_off, *dQ = scratch + L.dq_off;
  float* bias = scratch + L.bias_off;  // attn_mask's offsets of the current block, rows L.Bc apart
  const float* ones = scratch + L.ones_off;
  for (int64_t i0 = i_begin; i0 < i_end; i0 += kRowGroup) {
    fill_row(0.0f, dQ, kRowGroup * d_pad);
    const int64_t rows = std::min<int64_t>(kRowGroup, p.q_len - i0);
    const int64_t keys_seen = visible_keys(p, i0 + rows - 1);
    for (int64_t j = 0, j0 = 0; j0 < keys_seen; ++j, j0 += L.Bc) {
      int64_t n_keys = std::min(L.Bc, keys_seen - j0);
      const int64_t kv_tile = (b * p.num_kv_heads + kvh) * L.Tc + j;
      const MaskBlock block = mask_block(p, b, h, i0, rows, j0, n_keys, bias, L.Bc, 1);
      if (block == MaskBlock::hidden) continue;  // attn_mask hides the whole block: dS = 0
      if (block == MaskBlock::partial) n_keys = shown_keys_end(bias, L.Bc, rows, n_keys);
      const int64_t n_cols = round_up(n_keys, kKeyAlign);
      recompute_p_and_ds(p, L, ws, head, kv_tile, i0, j0, n_keys, n_cols,
                         block == MaskBlock::partial ? bias : nullptr, P, dS, scratch + L.grad_off);
      // dQ_g += dS K_j   (scale applied once below). As in the forward's P V_j: keys every row sees through
      // the micro-kernel, the causal diagonal's rest row by row, so a hidden key's K never meets a row. Where the
      // mask or window cuts the block and K_j holds a NaN or an infinity, each row adds the keys it sees one by one:
      // a hidden key's dS is 0, but 0 · inf would be NaN (README, "Non-finite values").
      const float* Kj = ws + L.kr_off + ((b * p.num_kv_heads + kvh) * L.k_pad + j0) * d_pad;
      if (block == MaskBlock::partial && ws[L.k_finite_off + kv_tile] == 0.0f) {
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t visible = std::clamp<int64_t>(visible_keys(p, i0 + r) - j0, 0, n_keys);
          for (int64_t t = 0; t < visible; ++t)
            if (bias[r * L.Bc + t] != kNegInf) axpy(dS[r * L.Bc + t], Kj + t * d_pad, dQ + r * d_pad, d);
        }
        continue;
      }
      const int64_t shared_keys = std::clamp<int64_t>(visible_keys(p, i0) - j0, 0, n_keys);
      group_gemm<kPvVecs>(kRowGroup, shared_keys, dS, L.Bc, 1, Kj, d_pad, d_pad, dQ, d_pad, ones);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t visible = std::clamp<int64_t>(visible_keys(p, i0 + r) - j0, 0, n_keys);
        if (visible > shared_keys)
          weighted_row_sum</*kAccumulate=*/true>(dS + r * L.Bc + shared_keys, Kj + shared_keys * d_pad, d_pad,
                                                 visible - shared_keys, dQ + r * d_pad, d_pad);
      }
    }
    T* dq_out = static_cast<T*>(bp.dq) + b * bp.dq_strides[0] + h * bp.dq_strides[1] + i0 * bp.dq_strides[2];
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < d; ++c) dq_out[r * bp.dq_strides[2] + c] = static_cast<T>(p.scale * dQ[r * d_pad + c]);
  }
}

template <class T>
void run(const AttentionBackwardParams& bp, float* ws) {
  const AttentionParams& p = bp.fwd;
  const Layout L(bp);
  float* thread_scratch = ws + L.shared;
  const int64_t n_query_rows = p.batch * p.num_heads * L.q_pad;
  const int64_t n_key_tiles = p.batch * p.num_kv_heads * L.Tc;
  const int64_t n_query_tiles = p.batch * p.num_heads * L.Tr;

#pragma omp parallel num_threads(p.num_threads)
  {
    float* scratch = thread_scratch + omp_get_thread_num() * L.per_thread;
    fill_row(1.0f, scratch + L.ones_off, std::max<int64_t>(L.Bc, kRowGroup));  // α = 1: accumulate
    // Packed sequences: each job reads sequence b as a call of its own (sequence_view), made once per run of jobs
    // of one sequence on this thread; a dense call is its own view.
    AttentionBackwardParams view = bp;
    int64_t view_of = -1;
    const auto seq = [&](int64_t b) -> const AttentionBackwardParams& {
      if (bp.fwd.cu_seqlens_q && b != view_of) view = sequence_view(bp, b), view_of = b;
      return view;
    };

    // 0. Pack the operands once, all threads together (zeros past a shorter sequence's rows and keys).
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < n_query_rows; ++t) {
      const int64_t b = t / (p.num_heads * L.q_pad);
      pack_query_row<T>(seq(b), L, ws, b, (t / L.q_pad) % p.num_heads, t % L.q_pad);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_key_tiles; ++t) {
      const int64_t b = t / (p.num_kv_heads * L.Tc);
      pack_key_tile<T>(seq(b), L, ws, b, (t / L.Tc) % p.num_kv_heads, t % L.Tc);
    }
    // (implicit barrier)

    // 1. dK, dV: one task per key tile. Causal: early key tiles meet the most query rows, so go first.
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t t = 0; t < n_key_tiles; ++t) {
      const int64_t b = t / (p.num_kv_heads * L.Tc), j = t % L.Tc;
      if (j * L.Bc < seq(b).fwd.kv_len) key_tile<T>(seq(b), L, ws, b, (t / L.Tc) % p.num_kv_heads, j, scratch);
    }

    // 2. dQ: one task per query tile; the costliest (last, under a causal mask) first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_query_tiles; ++t) {
      const int64_t i = L.Tr - 1 - t % L.Tr, h = (t / L.Tr) % p.num_heads, b = t / (L.Tr * p.num_heads);
      const int64_t q_len = seq(b).fwd.q_len;
      if (i * L.Br < q_len) query_tile<T>(seq(b), L, ws, b, h, i * L.Br, std::min((i + 1) * L.Br, q_len), scratch);
    }
  }
}

}  // namespace flash_backward

int64_t flash_backward_workspace_floats(const AttentionBackwardParams& bp) {
#if defined(CS149_ISA_BF16_DOT)
  if (flash_backward_bf16::applies(bp)) return flash_backward_bf16::workspace_floats(bp);
#endif
  if (flash_backward_onepass::applies(bp)) return flash_backward_onepass::workspace_floats(bp);
  const flash_backward::Layout L(bp);
  return L.shared + bp.fwd.num_threads * L.per_thread;
}

void flash_attention_backward(const AttentionBackwardParams& bp, float* workspace) {
#if defined(CS149_ISA_BF16_DOT)
  if (flash_backward_bf16::applies(bp)) return flash_backward_bf16::run(bp, workspace);
#endif
  if (flash_backward_onepass::applies(bp)) return flash_backward_onepass::run_any(bp, workspace);
  switch (bp.fwd.dtype) {
    case DType::f32: flash_backward::run<float>(bp, workspace); break;
    case DType::bf16: flash_backward::run<c10::BFloat16>(bp, workspace); break;
    case DType::f16: flash_backward::run<c10::Half>(bp, workspace); break;
  }
}

}  // namespace CS149_ISA
}  // namespace cs149gpt
