// Rung 4 in bfloat16, on the CPU's bf16 dot-product hardware (AMX tiles, or AVX512-BF16's vdpbf16ps).
//
// The same FlashAttention forward as flash.cpp — the same tiles, the same online softmax (flash_common.h) —
// with both products on bf16 operands and float32 accumulation (bf16_gemm.h):
//   S_ij = Q_i K_jᵀ                      bf16 · bf16 → float32
//   S_ij = scale · S_ij (+ attn_mask), then m, P_ij, l   in float32, as flash.cpp
//   O_i  = α · O_i + bf16(P_ij) V_j      bf16 · bf16 → float32
//   O_i  = O_i / l,  lse = m + log(l)
// Q is multiplied as it is and `scale` applied to S in float32, so the only roundings beyond float32's are
// P to bf16 (as torch's bf16 SDPA) and the output to bf16.
//
// K_jᵀ and V_j are packed once per call into VNNI pairs (bf16_gemm.h) by all threads, and shared by every
// query tile and every query head of a GQA group. The packing also notes whether a V tile holds a NaN or an
// infinity: a key hidden from a row by the causal mask has P = 0 there, and 0 · NaN would be NaN, so such a
// (rare) tile takes P V row by row over each row's visible keys instead (README, "Non-finite values").
//
// float16 and float32 (on AMX only; float32 when asked: takes_float32) take the same path with every operand
// in bf16 parts, x = x_0 + x_1 (+ x_2) (bf16_gemm.h, split_bf16): two parts hold a float16 exactly, three a float32.
// The tile products run at ~13× the float32 FMA rate, so the seven products float16 takes (four for S, three for
// P·V) and the twelve of float32 (six each) still cost less than the two of flash.cpp in float32 FMAs;
// query_tile has the arithmetic.
#include "../attention.h"
#include "bf16_gemm.h"
#include "flash_common.h"

#include <algorithm>
#include <omp.h>

#if defined(CS149_ISA_BF16_DOT)

namespace cs149gpt {
namespace CS149_ISA {
namespace flash_bf16 {

using flash::add_mask;
using flash::all_chunks_finite;
using flash::finish_rows;
using flash::mask_block;
using flash::MaskBlock;
using flash::online_softmax;
using flash::PackChunks;
using flash::prefetch_next_mask_block;
using flash::line_past;
using flash::round_up;
using flash::run_forward_tiles;
using flash::shown_keys_end;
using flash::split_packing;
constexpr int64_t G = kDotRows;  // query rows that go through QKᵀ → softmax → PV together
// Default tiles (heuristics.h; fewer query rows when the threads need more tasks: Layout). With AMX the products are
// cheap: longer key tiles amortise loading and storing a group's O_i through tile registers, taller query tiles the
// reads of K_j, V_j from the shared packing (a query tile's groups reuse them from L2).
constexpr int64_t kDefaultBlockQ = tiles::kBf16BlockQ;
constexpr int64_t kDefaultBlockK = tiles::kBf16BlockK;

inline int64_t floats_for(int64_t bf16_count) { return round_up((bf16_count + 1) / 2, 16); }

// The bf16 operands of bfloat16 inputs come in one part, of float16 ones in two, of float32 ones in three
// (query_tile); and the highest order of the products A_i·B_j (i + j) that S = Q Kᵀ and P V keep (bf16_gemm_parts).
template <class T>
constexpr int kParts = std::is_same_v<T, float> ? 3 : std::is_same_v<T, c10::Half> ? 2 : 1;
template <class T>
constexpr int kQkOrder = kParts<T> - 1 + (std::is_same_v<T, c10::Half> ? 1 : 0);  // float16: all four products
template <class T>
constexpr int kPvOrder = kParts<T> - 1;
template <class T>
constexpr bool kSmallFirst = std::is_same_v<T, float>;  // the order of the products' sums (bf16_gemm.h)
inline int64_t parts_of(const AttentionParams& p) {
  return p.dtype == DType::f32 ? kParts<float> : p.dtype == DType::f16 ? kParts<c10::Half> : kParts<c10::BFloat16>;
}

// float32 takes the tiles only when asked (module.cpp's set_float32_products("bf16_tiles")); by default flash.cpp's
// float32 FMAs. On a 16-core Xeon with AMX the tiles ran one thread 1.10–1.24× the FMAs' speed non-causal at head_dim
// 64–128 (0.95–1.13× causal), but all 16 threads 0.72–0.86× at every head_dim, and 8 threads 0.87–0.97× (whether AMX
// units shared by hyperthreads or the 3× larger packed K and V is the cause is not established). Choosing by the call's thread count would make the bits depend on it (tests/test_flash.py asserts
// they do not).
inline bool takes_float32(const AttentionParams& p) {
  return p.dtype == DType::f32 && p.f32_products == F32Products::bf16_tiles;
}

struct Layout {
  int64_t Br, Bc, Tr, Tc;
  int64_t parts;            // 1 (bfloat16), 2 (float16) or 3 (float32): the parts one after another, each as big
  int64_t Bc_pad;           // keys to whole dot-product steps (kDotK); Br is already whole groups
  int64_t s_ld, p_ld;       // row strides of S (floats) and P (bf16): a cache line past Bc_pad (line_past)
  int64_t d_k, d_n;         // head_dim as the k of Q Kᵀ (kDotK multiple) and as the n of P V (kDotCols)
  int64_t kt_tile, v_tile;  // bf16 per packed K_jᵀ (d_k × Bc_pad) and V_j (Bc_pad × d_n), per part
  int64_t kt_floats, v_floats, flags_floats;  // the shared, packed operands (in floats); V's flags, then K's
  int64_t ready_floats;                       // a counter of packed chunks per (batch, kv head), a line each
                                              // (int64), first in the workspace
  PackChunks pack;                            // each tile packed in chunks of whole VNNI blocks (flash_common.h)
  int64_t q_off, s_off, p_off, o_off, m_off, l_off, alpha_off, bias_off, per_thread;  // per-thread scratch (floats)

  explicit Layout(const AttentionParams& p) {
    parts = parts_of(p);
    Br = p.block_q > 0 ? round_up(std::min(p.block_q, p.q_len), G) : kDefaultBlockQ;  // clamped before rounding
    Bc = p.block_k > 0 ? p.block_k : kDefaultBlockK;
    if (p.block_q <= 0)
      while (Br > G && p.batch * p.num_heads * ((p.q_len + Br - 1) / Br) < 4 * p.num_threads) Br -= G;
    Br = std::min(Br, round_up(p.q_len, G));
    Bc = std::min(Bc, p.kv_len);
    Tr = (p.q_len + Br - 1) / Br;
    Tc = (p.kv_len + Bc - 1) / Bc;
    Bc_pad = round_up(Bc, kDotK);
    s_ld = line_past(Bc_pad, sizeof(float));  // Bc_pad apart, 2 KB at 512 keys: a tile's rows in two L1 sets
    p_ld = line_past(Bc_pad, sizeof(bf16_bits));
    d_k = round_up(p.head_dim, kDotK);
    d_n = round_up(p.head_dim, kDotCols);
    kt_tile = d_k * Bc_pad;
    v_tile = Bc_pad * d_n;
    const int64_t tiles = p.batch * p.num_kv_heads * Tc;
    kt_floats = floats_for(tiles * kt_tile * parts);
    v_floats = floats_for(tiles * v_tile * parts);
    pack = split_packing(p, Tc, Bc_pad, kDotK);
    flags_floats = round_up(tiles * pack.chunks * parts, 16);
    ready_floats = p.batch * p.num_kv_heads * flash::kCounterFloats;
    q_off = 0;                                        // Q_i, bf16, Br × d_k (per part)
    s_off = q_off + parts * floats_for(Br * d_k);     // S/P of one group, float32, G × s_ld
    p_off = s_off + G * s_ld;                         // P of one group, bf16, G × p_ld (per part)
    o_off = p_off + parts * floats_for(G * p_ld);     // O_i, float32, Br × d_n
    m_off = o_off + Br * d_n;
    l_off = m_off + round_up(Br, 16);
    alpha_off = l_off + round_up(Br, 16);
    bias_off = alpha_off + round_up(2 * G, 16);       // α and m_new of one group
    per_thread = bias_off + (has_mask_or_window(p) ? G * Bc_pad : 0);  // attn_mask's offsets, G × Bc_pad
  }
};

// Keys [first, first + keys) of kv head (b, kvh) into the packed K_jᵀ at kt and V_j at vt (each the chunk's first key;
// kP parts, L.kt_tile and L.v_tile bf16 apart), read through kv_row a run of rows at a time. A run that starts inside a
// B tile's 16 keys (K_jᵀ) or 32-row block (V_j) stops at its end: the packing functions write a run as a tile of its
// own. V's VNNI pairs join two consecutive keys: a pair split between two pages (an odd page size) is packed alone,
// its two rows as one strided pair. Returns the NaN/inf values met in K and in V.
template <int kP, class Src>
std::pair<int64_t, int64_t> pack_kv_runs(const AttentionParams& p, const Layout& L, int64_t b, int64_t kvh,
                                         int64_t first, int64_t keys, bf16_bits* kt, bf16_bits* vt) {
  const int64_t d = p.head_dim, ldk = p.k_strides[2], ldv = p.v_strides[2];
  int64_t k_bad = 0, v_bad = 0;
  for (int64_t i = 0, run; i < keys; i += run) {
    const Src* K = kv_row<Src>(p, p.k, p.k_strides, b, kvh, first + i, &run);
    run = std::min({run, keys - i, i % kDotCols ? kDotCols - i % kDotCols : keys});
    bf16_bits* at = kt + vnni_index(0, i, L.Bc_pad);
    if constexpr (kP == 1)
      pack_vnni_transposed(d, run, K, ldk, at, L.Bc_pad);
    else
      k_bad += pack_vnni_transposed_parts<kP>(d, run, K, ldk, at, L.kt_tile, L.Bc_pad);
  }
  const auto pack_rows = [&](int64_t n, const Src* V, int64_t ld, bf16_bits* at) {
    if constexpr (kP == 1)
      v_bad += pack_vnni_rows(n, d, V, ld, at, L.d_n);
    else
      v_bad += pack_vnni_rows_parts<kP>(n, d, V, ld, at, L.v_tile, L.d_n);
  };
  for (int64_t i = 0, run; i < keys; i += run) {
    const Src* V = kv_row<Src>(p, p.v, p.v_strides, b, kvh, first + i, &run);
    if (i % 2) {  // the pair (i − 1, i) across two pages: both rows again, the distance between them as the stride
      int64_t unused;
      const Src* prev = kv_row<Src>(p, p.v, p.v_strides, b, kvh, first + i - 1, &unused);
      pack_rows(2, prev, V - prev, vt + vnni_index(i - 1, 0, L.d_n));
      run = 1;
      continue;
    }
    run = std::min({run, keys - i, i % kDotK ? kDotK - i % kDotK : keys});
    pack_rows(run, V, ldv, vt + vnni_index(i, 0, L.d_n));
  }
  return {k_bad, v_bad};
}

// Chunk c of key tile j of kv head (b, kvh), keys [t0, t1) of the tile (whole kDotK blocks; L.pack): its keys of
// K_jᵀ as B of S = Q Kᵀ (k = head dim, n = key) and its rows of V_j as B of P V (k = key, n = head dim), both VNNI
// and zero-padded, each in its parts one after another. In K_jᵀ the chunk's keys are a run of 16-key blocks in each
// 32-row block (t0 · 32 bf16 in, b_tile_offset), in V_j a run of whole 32-row blocks (t0 · d_n in): the packing
// functions write there as into a tile of the chunk's keys. Flags, one a chunk (several parts: the K flags after the
// V flags): finite[tile · chunks + c] = 1 if the chunk's rows of V_j hold no NaN or infinity,
// finite[(tiles + tile) · chunks + c] the same for K_j.
void pack_kv_chunk(const AttentionParams& p, const Layout& L, int64_t b, int64_t kvh, int64_t j, int64_t c,
                   bf16_bits* kt_all, bf16_bits* v_all, float* finite) {
  const int64_t j0 = j * L.Bc, cols = std::min(L.Bc, p.kv_len - j0);
  const int64_t t0 = c * L.pack.keys, t1 = std::min(t0 + L.pack.keys, L.Bc_pad);
  const int64_t keys = std::clamp<int64_t>(cols - t0, 0, t1 - t0);  // the chunk's real keys; zero after them
  const int64_t tile = (b * p.num_kv_heads + kvh) * L.Tc + j, tiles = p.batch * p.num_kv_heads * L.Tc;
  const int64_t flag = tile * L.pack.chunks + c, k_flag = (tiles + tile) * L.pack.chunks + c;
  bf16_bits* kt = kt_all + tile * L.parts * L.kt_tile + t0 * kDotK;  // d_k/2 rows of Bc_pad pairs (each part)
  bf16_bits* vt = v_all + tile * L.parts * L.v_tile + t0 * L.d_n;    // Bc_pad/2 rows of d_n pairs (each part)
  for (int64_t part = 0; part < L.parts; ++part) {
    for (int64_t k0 = 0; k0 < L.d_k; k0 += kDotK)
      std::fill_n(kt + part * L.kt_tile + k0 * L.Bc_pad, (t1 - t0) * kDotK, bf16_bits{0});
    std::fill_n(vt + part * L.v_tile, (t1 - t0) * L.d_n, bf16_bits{0});
  }
  std::pair<int64_t, int64_t> bad;  // NaN/inf values in K, in V
  if (p.dtype == DType::bf16)
    bad = pack_kv_runs<1, bf16_bits>(p, L, b, kvh, j0 + t0, keys, kt, vt);
  else if (p.dtype == DType::f16)  // float16 as its bits
    bad = pack_kv_runs<2, uint16_t>(p, L, b, kvh, j0 + t0, keys, kt, vt);
  else
    bad = pack_kv_runs<3, float>(p, L, b, kvh, j0 + t0, keys, kt, vt);
  if (L.parts > 1) finite[k_flag] = bad.first == 0 ? 1.0f : 0.0f;
  finite[flag] = bad.second == 0 ? 1.0f : 0.0f;
}

inline float from_bf16(bf16_bits x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// An operand's element at `at`, the sum of its parts (`part` bf16 apart), in float32.
inline float value_of(const bf16_bits* x, int64_t parts, int64_t part, int64_t at) {
  float sum = 0.0f;
  for (int64_t i = parts - 1; i >= 0; --i) sum += from_bf16(x[i * part + at]);  // the smallest first
  return sum;
}

// O_g[r] += Σ_{t < visible[r]} P[r, t] · V_j[t] in float32, row by row: only for a V tile holding NaN or inf.
// With attn_mask's offsets (bias, rows ld_bias apart; null where it hides nothing) the keys it hides are left out too.
// P and V_j as their L.parts parts, p_part and L.v_tile bf16 apart.
void pv_visible_only(int64_t rows, const bf16_bits* P, int64_t p_part, int64_t ldp, const int64_t* visible,
                     const float* bias, int64_t ld_bias, const bf16_bits* vt, const Layout& L, int64_t d, float* O,
                     int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < visible[r]; ++t)
      if (!bias || bias[r * ld_bias + t] != kNegInf) {
        const float w = value_of(P, L.parts, p_part, r * ldp + t);
        for (int64_t c = 0; c < d; ++c)
          O[r * ldo + c] += w * value_of(vt, L.parts, L.v_tile, vnni_index(t, c, L.d_n));
      }
}

// S = Q_g K_jᵀ from operands in parts, added back (exact) and multiplied in float32: where Q_g or K_j holds an inf
// or NaN. The split's cross products are wrong there: where k is inf, q's x_1 times it gives NaN (x_1 = 0) or the
// wrong sign, and a logit that should be −inf would turn NaN (README, "Non-finite values": the logits are those of
// float32 arithmetic).
void qk_in_float32(int64_t rows, int64_t n_keys, int64_t d, int64_t parts, const bf16_bits* Q, int64_t q_part,
                   int64_t ldq, const bf16_bits* KT, int64_t kt_part, int64_t ldk, float* S, int64_t lds) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < n_keys; ++t) {
      float s = 0.0f;
      for (int64_t c = 0; c < d; ++c)
        s += value_of(Q, parts, q_part, r * ldq + c) * value_of(KT, parts, kt_part, vnni_index(c, t, ldk));
      S[r * lds + t] = s;
    }
}

// The online softmax writes P straight into bf16 (zero-padded to k_keys), the A operand of P V_j. With dropout,
// P is dropped in float32 (its sum, for l, taken before) and then rounded once.
struct PToBf16 {
  static constexpr bool kBase2 = false;
  bf16_bits* P;
  int64_t ld, k_keys;
  const AttentionParams* dropout = nullptr;  // with p.dropout_p > 0: the call, and row 0's head b·H + h, row, key
  int64_t bh = 0, i = 0, j0 = 0;
  flash::FusedLogit logit;  // softcap only
  float exp_sum(int64_t r, float* s, float shift, int64_t n, float scale) const {
    const float cap = logit.cap;
    if (cap > 0.0f && !dropout)
      return exp_shifted_sum_to_bf16_with(SoftcapExponent(shift, scale, cap), s, n, P + r * ld, k_keys);
    if (!dropout) return exp_shifted_sum_to_bf16(s, shift, n, scale, P + r * ld, k_keys);
    const float sum = cap > 0.0f ? exp2_sum_with(SoftcapExponent(shift, scale, cap).logit, s, n)
                                 : exp_shifted_sum(s, shift, n, scale);
    flash::dropout_row(*dropout, bh, i + r, j0, s, n, 1);
    for (int64_t t = 0; t < n; ++t) P[r * ld + t] = c10::BFloat16(s[t]).x;
    std::fill(P + r * ld + n, P + r * ld + k_keys, bf16_bits{0});
    return sum;
  }
  void zero(int64_t r, float*, int64_t) const { std::fill(P + r * ld, P + r * ld + k_keys, bf16_bits{0}); }
};

// The same for P in kP parts, `part` bf16 apart (float16: to 2^-17 relative; float32: to float32's rounding;
// bf16_gemm.h, split_bf16).
template <int kP>
struct PToBf16Parts {
  static constexpr bool kBase2 = false;
  bf16_bits* P;
  int64_t part, ld, k_keys;
  const AttentionParams* dropout = nullptr;
  int64_t bh = 0, i = 0, j0 = 0;
  flash::FusedLogit logit;  // softcap only
  float exp_sum(int64_t r, float* s, float shift, int64_t n, float scale) const {
    const float cap = logit.cap;
    if (cap > 0.0f && !dropout)
      return exp_shifted_sum_to_bf16_parts_with<kP>(SoftcapExponent(shift, scale, cap), s, n, P + r * ld, part,
                                                    k_keys);
    if (!dropout) return exp_shifted_sum_to_bf16_parts<kP>(s, shift, n, scale, P + r * ld, part, k_keys);
    if (cap > 0.0f) {
      const float sum = exp2_sum_with(SoftcapExponent(shift, scale, cap).logit, s, n);
      flash::dropout_row(*dropout, bh, i + r, j0, s, n, 1);
      split_row<kP>(s, n, P + r * ld, part, k_keys);
      return sum;
    }
    if (kP == 3) {  // float32: the row max's weight exactly 1, as exp_shifted_sum_to_bf16_parts
      scale_row(scale, s, n);
      scale = 1.0f;
    }
    const float sum = exp_shifted_sum(s, shift, n, scale);
    flash::dropout_row(*dropout, bh, i + r, j0, s, n, 1);
    split_row<kP>(s, n, P + r * ld, part, k_keys);
    return sum;
  }
  void zero(int64_t r, float*, int64_t) const {
    for (int k = 0; k < kP; ++k) std::fill(P + k * part + r * ld, P + k * part + r * ld + k_keys, bf16_bits{0});
  }
};

// One query tile: rows [i0, i0 + rows) of head h in batch b. T: c10::BFloat16; c10::Half in two parts; float in
// three.
//
// float16 in two bf16 parts. A float16 x has 11 significant bits: hi = bf16(x) holds the first 8 and
// lo = bf16(x − hi) the rest, so x = hi + lo exactly (bf16's exponent range covers float16's, subnormals too).
// With q = qh + ql, k = kh + kl (|ql| ≤ 2^-8·|q|, |kl| ≤ 2^-8·|k|):
//   q·k = qh·kh + qh·kl + ql·kh + ql·kl,
// each product of two bf16 exact in float32 and the tiles accumulating in float32: S is what float32 arithmetic
// gives. (Without the last product, up to 2^-16·Σ|q_c·k_c|, lse missed float32's accuracy: off by 1.5e-5 in
// tests/test_flash.py's Nq ≠ Nk test.) For P·V, P (float32, in [0, 1]) is split the same way,
// P ≈ Ph + Pl to 2^-17 relative, and V = Vh + Vl exactly:
//   P·V ≈ Ph·Vh + Ph·Vl + Pl·Vh,   off by at most (2^-16 + 2^-17)·Σ P·|V|,
// far below float16's rounding of the output (2^-11 relative). The tile products run at ~13× the float32 FMA
// rate: these seven cost about a quarter of the two products in float32 (flash.cpp). Where Q_g or K_j holds an
// inf or NaN the cross products would be wrong (q's lo · k's inf), so S takes float32 (qk_in_float32); V_j's
// are already taken row by row (pv_visible_only).
//
// float32 in three bf16 parts, x = x0 + x1 + x2 exactly (24 significant bits, 8 a part; |x1| ≤ 2^-8·|x|,
// |x2| ≤ 2^-16·|x|). Of the nine products q_a·k_b, S keeps the six with a + b ≤ 2; the three left out
// (q1·k2, q2·k1, q2·k2) are below 2^-23·Σ|q_c·k_c| together, under the float32 rounding of a d-term dot product.
// P·V the same with P = P0 + P1 + P2 (P rounded to float32 first, as flash.cpp's P is). Twelve tile products a key
// tile against flash.cpp's two float32 FMA products: one thread 1.1–1.25× faster at d ≥ 96, 8 and 16 threads
// slower (takes_float32).
template <class T>
void query_tile(const AttentionParams& p, const Layout& L, int64_t b, int64_t h, int64_t i0, const bf16_bits* kt_all,
                const bf16_bits* v_all, const float* finite, float* scratch) {
  constexpr int kP = kParts<T>;
  const int64_t d = p.head_dim, rows = std::min(L.Br, p.q_len - i0), groups = (rows + G - 1) / G;
  const int64_t tiles = p.batch * p.num_kv_heads * L.Tc;
  bf16_bits* Qi = reinterpret_cast<bf16_bits*>(scratch + L.q_off);
  const int64_t q_part = 2 * floats_for(L.Br * L.d_k);  // bf16 from one part of Q_i to the next
  bf16_bits* Pb = reinterpret_cast<bf16_bits*>(scratch + L.p_off);
  const int64_t p_part = 2 * floats_for(G * L.p_ld);
  float *S = scratch + L.s_off, *Oi = scratch + L.o_off, *m = scratch + L.m_off, *l = scratch + L.l_off;
  float *alpha = scratch + L.alpha_off, *m_new = alpha + G;
  float* bias = scratch + L.bias_off;  // attn_mask's offsets for the current group and key tile
  int64_t visible[G];

  // Q_i as bf16, or in parts (zero past the rows and the head dim); m = −inf, l = 0, O_i = 0.
  const T* Q = q_head<T>(p, b, h) + i0 * p.q_strides[2];
  for (int k = 0; k < kP; ++k) std::fill(Qi + k * q_part, Qi + k * q_part + groups * G * L.d_k, bf16_bits{0});
  bool q_finite = true;
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (kP == 1) {
      const bf16_bits* row = reinterpret_cast<const bf16_bits*>(Q + r * p.q_strides[2]);
      std::copy(row, row + d, Qi + r * L.d_k);
    } else if constexpr (std::is_same_v<T, c10::Half>) {  // as its bits
      q_finite &= split_row<kP>(reinterpret_cast<const uint16_t*>(Q + r * p.q_strides[2]), d, Qi + r * L.d_k, q_part,
                                d) == 0;
    } else {
      q_finite &= split_row<kP>(Q + r * p.q_strides[2], d, Qi + r * L.d_k, q_part, d) == 0;
    }
  }
  fill_row(kNegInf, m, groups * G);
  fill_row(0.0f, l, groups * G);
  fill_row(0.0f, Oi, groups * G * L.d_n);

  const int64_t first_tile = (b * p.num_kv_heads + kv_head(p, h)) * L.Tc;
  const flash::LogitMods mods(p, 1.0f);
  const int64_t keys_seen = visible_keys(p, i0 + rows - 1);  // by the tile's last row, which sees most
  for (int64_t j0 = 0, j = 0; j0 < keys_seen; j0 += L.Bc, ++j) {
    const int64_t cols = std::min(L.Bc, p.kv_len - j0), tile = first_tile + j;
    const bf16_bits* KTj = kt_all + tile * L.parts * L.kt_tile;
    const bf16_bits* Vj = v_all + tile * L.parts * L.v_tile;
    const bool v_finite = all_chunks_finite(finite + tile * L.pack.chunks, L.pack.chunks);
    const bool qk_finite = kP == 1 || (q_finite && all_chunks_finite(finite + (tiles + tile) * L.pack.chunks,
                                                                      L.pack.chunks));
    for (int64_t g0 = 0; g0 < rows; g0 += G) {
      const int64_t group_last = i0 + std::min(g0 + G, rows) - 1;
      int64_t n_keys = std::clamp<int64_t>(visible_keys(p, group_last) - j0, 0, cols);
      if (n_keys == 0) continue;
      // attn_mask: a block it hides whole is skipped, one it leaves whole takes the unmasked path, one it cuts
      // stops at the last key it shows. The next block's entries are asked for first (flash.cpp).
      const int64_t group_rows = std::min(G, rows - g0);
      n_keys = flash::window_keys_end(p, b, h, i0 + g0, group_rows, j0, n_keys);
      if (n_keys == 0) continue;
      prefetch_next_mask_block(p, b, h, i0, rows, g0, G, j0, L.Bc);
      // (Straight from the mask where it can be, flash_common.h; not where V_j holds a NaN or inf: pv_visible_only
      // reads the offsets.)
      const bool direct = flash::mask_rows_direct(p) && v_finite;
      const MaskBlock block = direct ? flash::classify_mask_block(p, b, h, i0 + g0, group_rows, j0, n_keys)
                                     : mask_block(p, b, h, i0 + g0, group_rows, j0, n_keys, bias, L.Bc_pad, 1);
      if (block == MaskBlock::hidden) continue;
      if (block == MaskBlock::partial)
        n_keys = direct ? flash::shown_keys_end_direct(p, b, h, i0 + g0, group_rows, j0, n_keys)
                        : shown_keys_end(bias, L.Bc_pad, group_rows, n_keys);

      // S = Q_g K_jᵀ   (G × n_keys, computed to whole column tiles; in parts: Σ_{a+b ≤ kQkOrder} q_a·k_b)
      const int64_t s_cols = round_up(n_keys, kDotCols);
      if constexpr (kP == 1)
        bf16_gemm(G, s_cols, L.d_k, Qi + g0 * L.d_k, L.d_k, KTj, L.Bc_pad, S, L.s_ld, false);
      else if (qk_finite)
        bf16_gemm_parts<kP, kQkOrder<T>, kSmallFirst<T>>(G, s_cols, L.d_k, Qi + g0 * L.d_k, q_part, L.d_k, KTj,
                                                         L.kt_tile, L.Bc_pad, S, L.s_ld, false);
      else
        qk_in_float32(G, s_cols, d, kP, Qi + g0 * L.d_k, q_part, L.d_k, KTj, L.kt_tile, L.Bc_pad, S, L.s_ld);
      // S = scale · S, softcap, ALiBi (on the keys each row sees, taking the rows' maxima where no mask is added
      // after: the softmax then reads S once, for its exp); + mask where the mask cuts the block (the softmax below
      // then scales by 1).
      const bool partial = block == MaskBlock::partial;
      const float mask_scale = mods.any ? 1.0f : p.scale;
      for (int64_t r = 0; r < G; ++r) visible[r] = std::clamp<int64_t>(visible_keys(p, i0 + g0 + r) - j0, 0, n_keys);
      // softcap alone, where no mask follows it, rides in the softmax's exp pass (fused) instead.
      const bool fused = mods.fused_softcap && !partial, mods_pass = mods.any && !fused;
      const bool max_in_mods = mods_pass && !partial;
      float row_max[G * Vec::width];
      if (max_in_mods) fill_row(kNegInf, row_max, G * Vec::width);
      if (mods_pass)
        for (int64_t r = 0; r < group_rows; ++r)
          mods.row(p, b, h, i0 + g0 + r, j0, S + r * L.s_ld, visible[r], p.scale, nullptr,
                   max_in_mods ? row_max + r * Vec::width : nullptr);
      if (partial)
        for (int64_t r = 0; r < group_rows; ++r) {
          if (direct)
            flash::add_mask_row(p, b, h, i0 + g0 + r, j0, S + r * L.s_ld, n_keys, /*unit=*/1.0f, mask_scale);
          else
            add_mask(S + r * L.s_ld, bias + r * L.Bc_pad, n_keys, /*unit=*/1.0f, mask_scale);
        }

      // S = scale · S, then the online softmax: P = exp(S − m_new) into Pb as bf16 (or in parts); m, l, α updated.
      const int64_t k_keys = round_up(n_keys, kDotK);  // P is 0 past n_keys (and V_j past cols)
      const AttentionParams* dropout = p.dropout_p > 0.0f ? &p : nullptr;
      const float softmax_scale = partial || mods_pass ? 1.0f : p.scale;
      const float cap = fused ? p.softcap : 0.0f;
      if constexpr (kP > 1)
        online_softmax(S, L.s_ld, G, n_keys, visible, softmax_scale, m + g0, l + g0, alpha, m_new,
                       PToBf16Parts<kP>{Pb, p_part, L.p_ld, k_keys, dropout, b * p.num_heads + h, i0 + g0, j0, {cap}},
                       max_in_mods ? row_max : nullptr);
      else
        online_softmax(S, L.s_ld, G, n_keys, visible, softmax_scale, m + g0, l + g0, alpha, m_new,
                       PToBf16{Pb, L.p_ld, k_keys, dropout, b * p.num_heads + h, i0 + g0, j0, {cap}},
                       max_in_mods ? row_max : nullptr);

      // O_g = α · O_g + P V_j   (in parts: Σ_{a+b ≤ kPvOrder} P_a·V_b)
      float* Og = Oi + g0 * L.d_n;
      for (int64_t r = 0; r < G; ++r) scale_row(alpha[r], Og + r * L.d_n, L.d_n);
      if (!v_finite)
        pv_visible_only(group_rows, Pb, p_part, L.p_ld, visible, partial ? bias : nullptr, L.Bc_pad, Vj, L, d, Og,
                        L.d_n);
      else if constexpr (kP == 1)
        bf16_gemm(G, L.d_n, k_keys, Pb, L.p_ld, Vj, L.d_n, Og, L.d_n, true);
      else
        bf16_gemm_parts<kP, kPvOrder<T>, kSmallFirst<T>>(G, L.d_n, k_keys, Pb, p_part, L.p_ld, Vj, L.v_tile, L.d_n,
                                                         Og, L.d_n, true);
    }
  }
  finish_rows<T>(p, b, h, i0, rows, Oi, L.d_n, m, l);
}

template <class T>
void run(const AttentionParams& p, float* workspace) {
  const Layout L(p);
  int64_t* ready = reinterpret_cast<int64_t*>(workspace);  // first: the workspace's start is 64-byte aligned
  workspace += L.ready_floats;
  bf16_bits* kt_all = reinterpret_cast<bf16_bits*>(workspace);
  bf16_bits* v_all = reinterpret_cast<bf16_bits*>(workspace + L.kt_floats);
  float* finite = workspace + L.kt_floats + L.v_floats;
  float* thread_scratch = finite + L.flags_floats;
  // Every K and V tile packed once, chunk by chunk, beside the query tiles of the kv heads before (flash_common.h),
  // each thread under our AMX tile configuration (DotScope: the previous one restored after).
  run_forward_tiles<DotScope>(
      p, L.Br, L.Tr, L.Tc * L.pack.chunks, ready, thread_scratch, L.per_thread,
      [&](int64_t b, int64_t kvh, int64_t u) {
        const AttentionParams seq = sequence_view(p, b);  // packed sequences: b's own keys (p itself otherwise)
        if (u / L.pack.chunks * L.Bc < seq.kv_len)       // (past a shorter sequence's keys: never read)
          pack_kv_chunk(seq, L, b, kvh, u / L.pack.chunks, u % L.pack.chunks, kt_all, v_all, finite);
      },
      [&](int64_t b, int64_t h, int64_t i0, float* scratch) {
        const AttentionParams seq = sequence_view(p, b);
        if (i0 < seq.q_len) query_tile<T>(seq, L, b, h, i0, kt_all, v_all, finite, scratch);
      });
}

inline int64_t workspace_floats(const AttentionParams& p) {
  const Layout L(p);
  return L.kt_floats + L.v_floats + L.flags_floats + L.ready_floats + p.num_threads * L.per_thread;
}

}  // namespace flash_bf16
}  // namespace CS149_ISA
}  // namespace cs149gpt

#endif  // CS149_ISA_BF16_DOT
