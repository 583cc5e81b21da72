// The one-pass FlashAttention-2 backward (flash_backward_onepass.cpp) in bfloat16, on the CPU's bf16 dot-product
// hardware (AMX tiles or AVX512-BF16's vdpbf16ps, bf16_gemm.h): every product takes bf16 operands and accumulates in
// float32, and dQ, dK, dV accumulate in float32 across all tiles (torch's bf16 backward rounds its partial
// gradients to bf16 between blocks; here each gradient is rounded once, when written).
//
// The tile products run transposed, keys as rows, so that each one's B operand is a cheap VNNI packing (pairs
// of consecutive rows) and nothing is transposed per tile pair but Q_i and dO_i once each:
//   Sᵀ   = K_j Q_iᵀ                      Pᵀ = exp(scale·Sᵀ [+ Mᵀ] − lse), 0 where a query does not see the key
//   dPᵀ  = (V_j dO_iᵀ) ∘ Zᵀ              dSᵀ = Pᵀ ∘ (dPᵀ − D)           (lse, D: one per column)
//   dV_j += (P ∘ Z)ᵀ dO_i                (P ∘ Z)ᵀ rounded to bf16        (Z: dropout's keep mask / (1 − p), or 1)
//   dK_j += dSᵀ Q_i                      dSᵀ rounded to bf16            (× scale when written)
//   dQ_iᵀ += K_jᵀ dSᵀ                    dQᵀ of the task, float32         (× scale, transposed back, when written)
// One task per (batch, kv head), as the float32 one-pass kernel: it owns dQ of its group's query heads and dK, dV
// of its kv head, so the bits do not depend on the thread count. Memory per thread: the task's dQᵀ, lse and D, and
// the task's Qᵀ and dOᵀ (packed once per task where small, kMaxCachedQuery; else per tile pair), and the tiles;
// K_jᵀ is packed per key tile, Q_i and dO_i by rows per tile pair. The key tile goes through each tile pair in
// strips of 32 keys: Sᵀ, dPᵀ, Pᵀ, dSᵀ are one strip's, and a whole strip of K_j, V_j is the products' A operand in
// place (rows of k and v), so only a last partial strip is packed.
//
// A key tile whose K holds a NaN or an infinity takes dQᵀ += K_jᵀ dSᵀ key by key over each query's visible keys
// instead (a hidden key has dS = 0, and 0 · inf would be NaN: README, "Non-finite values").
#include "../attention.h"
#include "bf16_gemm.h"
#include "flash_common.h"

#include <algorithm>
#include <omp.h>

#if defined(CS149_ISA_BF16_DOT)

namespace cs149gpt {
namespace CS149_ISA {
namespace flash_backward_bf16 {

using flash::line_past;
using flash::round_up;
using flash::dropout_column;
using flash::MaskBlock;
using flash_backward_onepass::KeyRange;
using flash_backward_onepass::visible_key_range;  // the one definition of which keys a query row sees
namespace key_runs = flash_backward_onepass::key_runs;  // the order of key runs' dQ merges, shared

// Tiles, both whole dot-product steps (32) and at most kMaxTile; defaults by head_dim and ISA (heuristics.h). The
// 256-key tile keeps peak memory under torch SDPA's backward because the scores are handled in strips of 32 keys
// (tile_pair) and whole strips of K and V are read in place (Layout): (1,16,4096,128), 16 threads, 87.9 MiB against
// SDPA's 89.1; 92.3 MiB with whole-tile scratch.
constexpr int64_t kStep = 32;  // kDotK, and AMX's 32-row blocks of C: the strips of keys of tile_pair
constexpr int64_t kMaxTile = 512;
inline int64_t default_block_q(int64_t head_dim) { return tiles::bf16_backward_block_q(head_dim); }
constexpr int64_t kDefaultBlockK = tiles::kBf16BackwardBlockK;
// A task packs Qᵀ and dOᵀ of its query rows once (instead of once per tile pair: a third of the pair's time on a
// 2-core EPYC) when they take at most this many bf16 each. Beyond, the cache would make the backward's memory exceed
// torch's, which keeps a float32 dQ per thread as we do (1,16,4096,128: 89 MiB for torch, 121 with the cache).
constexpr int64_t kMaxCachedQuery = int64_t{1} << 18;
constexpr float kLog2e = 1.44269504088896341f;

inline int64_t floats_for(int64_t bf16_count) { return round_up((bf16_count + 1) / 2, 16); }

// Whether the products may read whole 32-key strips of K and V in place as their A operand (rows lda apart):
// head_dim a whole number of dot-product steps (no zero padding to add), and every row starting on a 4-byte
// boundary with an even stride (vdpbf16ps reads A two bf16 at a time as one 32-bit word).
inline bool rows_in_place(const void* base, const int64_t (&strides)[3], int64_t head_dim) {
  return head_dim % kDotK == 0 && reinterpret_cast<uintptr_t>(base) % 4 == 0 && strides[0] % 2 == 0 &&
         strides[1] % 2 == 0 && strides[2] % 2 == 0;
}

struct Layout {
  int64_t Br, Bc, Tc, q_pad, d_k, d_n, group_size, chunks, pairs, tasks, threads, packed_keys;
  int64_t dqt_ld;  // dQᵀ's row stride, a cache line past q_pad (line_past: 4 KB apart at 1024 queries, one L1 set)
  bool cache_query;     // Qᵀ, dOᵀ packed once per task (else per tile pair)
  bool keys_in_place;   // whole strips of K_j, V_j read in place; only a last partial strip is packed
  // shared, with key chunks: flash_backward_onepass.cpp's key_runs header, then each kv head's dQᵀ sum, float32
  // (sum_slots × dq_size): a run adds its own dQᵀ to it in the order of the runs and the last run writes dq. One sum
  // per kv head, not one partial per run: (1,12,1024,64) in 4 runs, one thread, the partials took 12.8 MB (peak
  // backward 17.3 MiB against torch's 7.7). On one thread the runs go kv head by kv
  // head (pair_major) and one sum serves them all, in turn: that call's peak is then under torch's (its float32 dQ
  // is a whole call's); on several threads the runs go key chunk by key chunk (key_runs::take_in_order) and every
  // kv head's sum is live at once. The sums' order of additions, hence the bits, is the same either way.
  bool pair_major;
  int64_t sum_slots, dq_sums, shared;
  // per thread, in floats: the task's dQᵀ (group × d_k × dqt_ld), lse·log2(e) (lse with attn_mask) and D
  // (group × q_pad);
  // K_j, V_j by rows (packed_keys × d_k bf16: the whole tile, or one strip of 32 keys when read in place), K_jᵀ
  // (d_k × Bc bf16); Qᵀ, dOᵀ of the task's query rows in VNNI pairs, query tile by query tile (group ×
  // q_pad/Br × d_k × Br bf16), else of one query tile; Q_i, dO_i in VNNI pairs (Br × d_n bf16);
  // Sᵀ, dPᵀ of one strip (32 × Br float32); Pᵀ, dSᵀ of one strip (32 × Br bf16); dSᵀ of the tile in VNNI pairs
  // (Bc × Br bf16); dK_j, dV_j (Bc × d_n float32); each query column's visible keys (Br int32 twice); with dropout,
  // Z of one key row (Br float32); with attn_mask, its offsets over one strip (32 × Br float32, keys as rows)
  int64_t dqt_off, lse2_off, delta_off, kr_off, vr_off, kt_off, qt_off, dot_off, qv_off, dov_off, st_off, dpt_off,
      pt_off, dst_off, dsv_off, dk_off, dv_off, begin_off, end_off, keep_off, bias_off, per_thread;

  explicit Layout(const AttentionBackwardParams& bp) {
    const AttentionParams& p = bp.fwd;
    Br = p.block_q > 0 ? round_up(std::min(p.block_q, p.q_len), kStep) : default_block_q(p.head_dim);
    Bc = p.block_k > 0 ? round_up(std::min(p.block_k, p.kv_len), kStep) : kDefaultBlockK;
    Br = std::min({Br, round_up(p.q_len, kStep), kMaxTile});
    Bc = std::min({Bc, round_up(p.kv_len, kStep), kMaxTile});
    q_pad = round_up(p.q_len, Br);
    dqt_ld = line_past(q_pad, sizeof(float));
    d_k = round_up(p.head_dim, kDotK);     // k of Sᵀ, dPᵀ; rows (M) of dQᵀ
    d_n = round_up(p.head_dim, kDotCols);  // n of dV, dK
    group_size = p.num_heads / p.num_kv_heads;
    Tc = (p.kv_len + Bc - 1) / Bc;
    chunks = std::clamp<int64_t>(bp.key_chunks, 1, Tc);
    pairs = p.batch * p.num_kv_heads;
    tasks = pairs * chunks;
    threads = std::max<int64_t>(1, std::min<int64_t>(p.num_threads, tasks));
    keys_in_place = rows_in_place(p.k, p.k_strides, p.head_dim) && rows_in_place(p.v, p.v_strides, p.head_dim);
    packed_keys = keys_in_place ? kStep : Bc;
    const int64_t dq_size = group_size * d_k * dqt_ld;
    dq_sums = key_runs::header_floats(pairs);
    pair_major = threads == 1;
    sum_slots = pair_major ? 1 : pairs;
    shared = chunks > 1 ? dq_sums + sum_slots * dq_size : 0;
    dqt_off = 0;
    lse2_off = dqt_off + dq_size;
    delta_off = lse2_off + group_size * q_pad;
    kr_off = delta_off + group_size * q_pad;
    vr_off = kr_off + floats_for(packed_keys * d_k);
    kt_off = vr_off + floats_for(packed_keys * d_k);
    cache_query = group_size * d_k * q_pad <= kMaxCachedQuery;
    const int64_t query_t = cache_query ? group_size * d_k * q_pad : d_k * Br;
    qt_off = kt_off + floats_for(d_k * Bc);
    dot_off = qt_off + floats_for(query_t);
    qv_off = dot_off + floats_for(query_t);
    dov_off = qv_off + floats_for(Br * d_n);
    st_off = dov_off + floats_for(Br * d_n);
    dpt_off = st_off + kStep * Br;
    pt_off = dpt_off + kStep * Br;
    dst_off = pt_off + floats_for(kStep * Br);
    dsv_off = dst_off + floats_for(kStep * Br);
    dk_off = dsv_off + floats_for(Bc * Br);
    dv_off = dk_off + Bc * d_n;
    begin_off = dv_off + Bc * d_n;
    end_off = begin_off + round_up(Br, 16);
    keep_off = end_off + round_up(Br, 16);
    bias_off = keep_off + (p.dropout_p > 0.0f ? round_up(Br, 16) : 0);
    per_thread = bias_off + (p.mask_kind != MaskKind::none ? kStep * Br : 0);
  }
};

inline float from_bf16(bf16_bits x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline const bf16_bits* row_of(const void* base, const int64_t (&strides)[3], int64_t b, int64_t h, int64_t i) {
  return static_cast<const bf16_bits*>(base) + b * strides[0] + h * strides[1] + i * strides[2];
}

struct Scratch {
  float *dQT, *lse2, *delta, *ST, *dPT, *dK, *dV, *keep, *bias;
  float* workspace;  // the call's: with key chunks, the task counter, the merge turns and the kv heads' dQᵀ sums
  bf16_bits *Kr, *Vr, *KT, *QT, *dOT, *Qv, *dOv, *PT, *dST, *dSv;
  int32_t *begin, *end;
  Scratch(const Layout& L, float* s, float* ws)
      : dQT(s + L.dqt_off), lse2(s + L.lse2_off), delta(s + L.delta_off), ST(s + L.st_off), dPT(s + L.dpt_off),
        dK(s + L.dk_off), dV(s + L.dv_off), keep(s + L.keep_off), bias(s + L.bias_off), workspace(ws),
        Kr(reinterpret_cast<bf16_bits*>(s + L.kr_off)),
        Vr(reinterpret_cast<bf16_bits*>(s + L.vr_off)), KT(reinterpret_cast<bf16_bits*>(s + L.kt_off)),
        QT(reinterpret_cast<bf16_bits*>(s + L.qt_off)), dOT(reinterpret_cast<bf16_bits*>(s + L.dot_off)),
        Qv(reinterpret_cast<bf16_bits*>(s + L.qv_off)), dOv(reinterpret_cast<bf16_bits*>(s + L.dov_off)),
        PT(reinterpret_cast<bf16_bits*>(s + L.pt_off)), dST(reinterpret_cast<bf16_bits*>(s + L.dst_off)),
        dSv(reinterpret_cast<bf16_bits*>(s + L.dsv_off)), begin(reinterpret_cast<int32_t*>(s + L.begin_off)),
        end(reinterpret_cast<int32_t*>(s + L.end_off)) {}
};

// lse·log2(e) (lse itself with attn_mask) and D = rowsum(dO ∘ O) of every query row of head h (rows past q_len: +inf
// and 0, never seen).
void row_statistics(const AttentionBackwardParams& bp, const Layout& L, int64_t b, int64_t h, float* lse2,
                    float* delta) {
  const AttentionParams& p = bp.fwd;
  for (int64_t i = 0; i < L.q_pad; ++i) {
    if (i >= p.q_len) {
      lse2[i] = std::numeric_limits<float>::infinity();
      delta[i] = 0.0f;
      continue;
    }
    const bf16_bits *g = row_of(bp.dout, bp.dout_strides, b, h, i), *o = row_of(p.out, p.out_strides, b, h, i);
    delta[i] = dot_bf16(g, o, p.head_dim);
    // lse = −inf (a row that sees no key) as +inf: exp(S − inf) = 0. NaN stays NaN. With attn_mask, lse itself:
    // softmax_backward_row_to_bf16 then sums the exponent in natural units (a mask of finfo.min would overflow).
    const float l = p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i];
    lse2[i] = (l == kNegInf ? std::numeric_limits<float>::infinity() : l) * (p.mask_kind != MaskKind::none ? 1.0f : kLog2e);
  }
}

// Q_iᵀ and dO_iᵀ in VNNI pairs (B of Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ: k = head dim, n = query row) for every
// query tile of head h, tile after tile (d_k × Br each), zero past q_len and head_dim. Once per task: every key
// tile reads them.
void pack_query_tiles(const AttentionBackwardParams& bp, const Layout& L, int64_t b, int64_t h, bf16_bits* QT,
                      bf16_bits* dOT) {
  const AttentionParams& p = bp.fwd;
  std::fill(QT, QT + L.q_pad * L.d_k, bf16_bits{0});
  std::fill(dOT, dOT + L.q_pad * L.d_k, bf16_bits{0});
  for (int64_t i0 = 0; i0 < p.q_len; i0 += L.Br) {
    const int64_t rows = std::min(L.Br, p.q_len - i0);
    pack_vnni_transposed(p.head_dim, rows, row_of(p.q, p.q_strides, b, h, i0), p.q_strides[2], QT + i0 * L.d_k, L.Br);
    pack_vnni_transposed(p.head_dim, rows, row_of(bp.dout, bp.dout_strides, b, h, i0), bp.dout_strides[2],
                         dOT + i0 * L.d_k, L.Br);
  }
}

// Key tile [j0, j0 + n_keys) of kv head (b, kvh): where its rows are, and whether K_j is all finite.
struct KeyTile {
  int64_t j0, n_keys;
  const bf16_bits *K, *V;  // its first key and value rows in k and v, rows k_ld and v_ld apart
  int64_t k_ld, v_ld;
  bool k_finite;
};

// Packs key tile [j0, j0 + n_keys) of kv head (b, kvh): K_jᵀ (zero past the keys and head_dim), and K_j, V_j by rows
// (zero past the keys and head_dim): all of them, or where whole strips are read in place (L.keys_in_place) only
// the keys of a last partial strip, from row 0.
KeyTile pack_key_tile(const AttentionParams& p, const Layout& L, int64_t b, int64_t kvh, int64_t j0, int64_t n_keys,
                      const Scratch& s) {
  const int64_t d = p.head_dim;
  const KeyTile tile{j0,          n_keys, row_of(p.k, p.k_strides, b, kvh, j0), row_of(p.v, p.v_strides, b, kvh, j0),
                     p.k_strides[2], p.v_strides[2], true};
  const int64_t packed_from = L.keys_in_place ? n_keys / kStep * kStep : 0;  // keys before it: read in place
  std::fill(s.Kr, s.Kr + L.packed_keys * L.d_k, bf16_bits{0});
  std::fill(s.Vr, s.Vr + L.packed_keys * L.d_k, bf16_bits{0});
  std::fill(s.KT, s.KT + L.d_k * L.Bc, bf16_bits{0});
  for (int64_t t = packed_from; t < n_keys; ++t) {
    std::copy(tile.K + t * tile.k_ld, tile.K + t * tile.k_ld + d, s.Kr + (t - packed_from) * L.d_k);
    std::copy(tile.V + t * tile.v_ld, tile.V + t * tile.v_ld + d, s.Vr + (t - packed_from) * L.d_k);
  }
  KeyTile result = tile;
  result.k_finite = transpose_bf16(tile.K, tile.k_ld, n_keys, d, s.KT, L.Bc) == 0;
  return result;
}

// The A operand of the strip of keys [t0, t0 + 32) of a key tile, rows *ld apart: in k or v where the strip is whole
// and L.keys_in_place, else the packed rows (pack_key_tile).
inline const bf16_bits* key_strip(const Layout& L, const KeyTile& tile, const bf16_bits* in_place, int64_t ld,
                                  const bf16_bits* packed, int64_t t0, int64_t* strip_ld) {
  if (!L.keys_in_place) {
    *strip_ld = L.d_k;
    return packed + t0 * L.d_k;
  }
  if (t0 + kStep <= tile.n_keys) {
    *strip_ld = ld;
    return in_place + t0 * ld;
  }
  *strip_ld = L.d_k;
  return packed;  // the last, partial strip
}

// One tile pair: query rows [i0, i0 + Br) of head h (group member g) against a key tile. The keys go through in
// strips of 32 (AMX's blocks of C rows, the products' own order, so the bits are those of whole-tile products):
// Sᵀ, dPᵀ, Pᵀ, dSᵀ exist one strip at a time, which keeps the scratch of a 256-key tile within the memory target.
void tile_pair(const AttentionBackwardParams& bp, const Layout& L, int64_t b, int64_t h, int64_t g, int64_t i0,
               const KeyTile& tile, const Scratch& s) {
  const AttentionParams& p = bp.fwd;
  const int64_t d = p.head_dim, Br = L.Br, rows = std::min(Br, p.q_len - i0), j0 = tile.j0, n_keys = tile.n_keys;

  // Each query column's visible keys in this tile, [begin, end); the columns and key rows some query sees.
  int64_t first_col = Br, last_col = 0, max_end = 0;
  for (int64_t c = 0; c < Br; ++c) {
    const KeyRange r = visible_key_range(p, b, h, i0 + c);
    const int64_t begin = std::clamp<int64_t>(r.begin - j0, 0, n_keys), end = std::clamp<int64_t>(r.end - j0, 0, n_keys);
    s.begin[c] = static_cast<int32_t>(begin);
    s.end[c] = static_cast<int32_t>(std::max(begin, end));
    if (end > begin) {
      first_col = std::min(first_col, c);
      last_col = c + 1;
      max_end = std::max(max_end, end);
    }
  }
  if (first_col >= last_col) return;
  const int64_t c0 = first_col / kStep * kStep, c1 = round_up(last_col, kStep), n_q = c1 - c0;
  const int64_t m_keys = round_up(max_end, kStep);  // key rows computed

  // Q_i and dO_i by rows in VNNI pairs (B of dK, dV: k = query row); transposed (B of Sᵀ, dPᵀ: k = head dim),
  // packed once per task.
  const bf16_bits *Q = row_of(p.q, p.q_strides, b, h, i0), *dO = row_of(bp.dout, bp.dout_strides, b, h, i0);
  std::fill(s.Qv, s.Qv + Br * L.d_n, bf16_bits{0});
  std::fill(s.dOv, s.dOv + Br * L.d_n, bf16_bits{0});
  const int64_t tile_t = (g * L.q_pad + i0) * L.d_k;  // this query tile's Q_iᵀ, dO_iᵀ (pack_query_tiles)
  const bf16_bits *QT = L.cache_query ? s.QT + tile_t : s.QT, *dOT = L.cache_query ? s.dOT + tile_t : s.dOT;
  if (!L.cache_query) {
    std::fill(s.QT, s.QT + L.d_k * Br, bf16_bits{0});
    std::fill(s.dOT, s.dOT + L.d_k * Br, bf16_bits{0});
    pack_vnni_transposed(d, rows, Q, p.q_strides[2], s.QT, Br);
    pack_vnni_transposed(d, rows, dO, bp.dout_strides[2], s.dOT, Br);
  }
  pack_vnni_rows(rows, d, Q, p.q_strides[2], s.Qv, L.d_n);
  pack_vnni_rows(rows, d, dO, bp.dout_strides[2], s.dOv, L.d_n);

  const float *lse2 = s.lse2 + g * L.q_pad + i0, *delta = s.delta + g * L.q_pad + i0;
  float* dQT = s.dQT + g * L.d_k * L.dqt_ld + i0;
  for (int64_t t0 = 0; t0 < m_keys; t0 += kStep) {
    // attn_mask over the strip (its 32 keys × the queries [c0, c1)): hidden whole, the strip adds nothing (its dSᵀ
    // is 0 in dQ's operand); cut, its offsets go to the softmax, M[t·Br + c] for key t0 + t and query c0 + c.
    const float* M = nullptr;
    if (p.mask_kind != MaskKind::none) {
      const MaskBlock block = flash::mask_block(p, b, h, i0 + c0, std::min(n_q, p.q_len - i0 - c0), j0 + t0,
                                                std::min(kStep, n_keys - t0), s.bias, 1, Br);
      if (block == MaskBlock::hidden) {
        if (tile.k_finite) std::fill(s.dSv + b_tile_offset(t0, 0, Br), s.dSv + b_tile_offset(t0, 0, Br) + kStep * Br,
                                     bf16_bits{0});
        continue;
      }
      if (block == MaskBlock::partial) M = s.bias;
    }
    // Sᵀ = K_j Q_iᵀ, dPᵀ = V_j dO_iᵀ   (the strip's 32 keys × n_q, float32)
    int64_t k_ld, v_ld;
    const bf16_bits* K = key_strip(L, tile, tile.K, tile.k_ld, s.Kr, t0, &k_ld);
    const bf16_bits* V = key_strip(L, tile, tile.V, tile.v_ld, s.Vr, t0, &v_ld);
    bf16_gemm(kStep, n_q, L.d_k, K, k_ld, QT + b_tile_offset(0, c0, Br), Br, s.ST + c0, Br, false);
    bf16_gemm(kStep, n_q, L.d_k, V, v_ld, dOT + b_tile_offset(0, c0, Br), Br, s.dPT + c0, Br, false);

    // (P ∘ Z)ᵀ, dSᵀ in bf16, 0 where the query does not see the key
    for (int64_t t = 0; t < kStep; ++t) {
      if (p.dropout_p > 0.0f) dropout_column(p, b * p.num_heads + h, i0 + c0, j0 + t0 + t, s.keep + c0, n_q);
      softmax_backward_row_to_bf16(s.ST + t * Br + c0, s.dPT + t * Br + c0, lse2 + c0, delta + c0, s.begin + c0,
                                   s.end + c0, static_cast<int32_t>(t0 + t), p.scale, n_q, s.PT + t * Br + c0,
                                   s.dST + t * Br + c0, p.dropout_p > 0.0f ? s.keep + c0 : nullptr,
                                   M ? M + t * Br : nullptr, /*lse_natural=*/p.mask_kind != MaskKind::none);
    }

    // dV_j += (P ∘ Z)ᵀ dO_i, dK_j += dSᵀ Q_i   (the strip's rows of dV_j, dK_j; k: the query rows [c0, c1))
    bf16_gemm(kStep, L.d_n, n_q, s.PT + c0, Br, s.dOv + b_tile_offset(c0, 0, L.d_n), L.d_n, s.dV + t0 * L.d_n,
              L.d_n, true);
    bf16_gemm(kStep, L.d_n, n_q, s.dST + c0, Br, s.Qv + b_tile_offset(c0, 0, L.d_n), L.d_n, s.dK + t0 * L.d_n,
              L.d_n, true);

    // dSᵀ of the strip into the VNNI pairs of the tile's (B of dQᵀ below: k = key); or, where K_j is not all
    // finite, dQᵀ += K_jᵀ dSᵀ key by key over each query's visible keys of the strip (the same order of sums)
    if (tile.k_finite) {
      pack_vnni_rows(kStep, n_q, s.dST + c0, Br, s.dSv + b_tile_offset(t0, 0, Br), Br);
    } else {
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t t = std::max<int64_t>(s.begin[c], t0); t < std::min<int64_t>(s.end[c], t0 + kStep); ++t) {
          if (M && M[(t - t0) * Br + (c - c0)] == kNegInf) continue;  // a key the mask hides (dS 0, K maybe inf)
          const float ds = from_bf16(s.dST[(t - t0) * Br + c]);
          const bf16_bits* k = tile.K + t * tile.k_ld;
          for (int64_t e = 0; e < d; ++e) dQT[e * L.dqt_ld + c] += ds * from_bf16(k[e]);
        }
    }
  }

  // dQ_iᵀ += K_jᵀ dSᵀ   (d_k × n_q; k: the keys)
  if (tile.k_finite) bf16_gemm(L.d_k, n_q, m_keys, s.KT, L.Bc, s.dSv, Br, dQT + c0, L.dqt_ld, true);
}

// The task of chunk `chunk` of kv head kvh in batch b (key tiles [chunk·Tc/C, (chunk+1)·Tc/C)): dK, dV of its keys,
// its share of the dQᵀ of the group's query heads into s.dQT, written out here when the task has all the keys (else
// merged into the kv head's sum, and written out by the last run).
void kv_head_task(const AttentionBackwardParams& bp, const Layout& L, int64_t b, int64_t kvh, int64_t chunk,
                  const Scratch& s) {
  const AttentionParams& p = bp.fwd;
  const int64_t d = p.head_dim, h0 = kvh * L.group_size;
  fill_row(0.0f, s.dQT, L.group_size * L.d_k * L.dqt_ld);
  for (int64_t g = 0; g < L.group_size; ++g) {
    row_statistics(bp, L, b, h0 + g, s.lse2 + g * L.q_pad, s.delta + g * L.q_pad);
    if (L.cache_query) pack_query_tiles(bp, L, b, h0 + g, s.QT + g * L.q_pad * L.d_k, s.dOT + g * L.q_pad * L.d_k);
  }

  for (int64_t j = chunk * L.Tc / L.chunks; j < (chunk + 1) * L.Tc / L.chunks && j * L.Bc < p.kv_len; ++j) {
    const int64_t j0 = j * L.Bc, n_keys = std::min(L.Bc, p.kv_len - j0);
    const KeyTile tile = pack_key_tile(p, L, b, kvh, j0, n_keys, s);
    fill_row(0.0f, s.dK, L.Bc * L.d_n);
    fill_row(0.0f, s.dV, L.Bc * L.d_n);
    for (int64_t g = 0; g < L.group_size; ++g)
      for (int64_t i0 = 0; i0 < p.q_len; i0 += L.Br) tile_pair(bp, L, b, h0 + g, g, i0, tile, s);
    auto* dk_out = static_cast<c10::BFloat16*>(bp.dk) + b * bp.dk_strides[0] + kvh * bp.dk_strides[1] +
                   j0 * bp.dk_strides[2];
    auto* dv_out = static_cast<c10::BFloat16*>(bp.dv) + b * bp.dv_strides[0] + kvh * bp.dv_strides[1] +
                   j0 * bp.dv_strides[2];
    for (int64_t t = 0; t < n_keys; ++t) {
      store_scaled_bf16(s.dK + t * L.d_n, p.scale, d, reinterpret_cast<bf16_bits*>(dk_out + t * bp.dk_strides[2]));
      store_scaled_bf16(s.dV + t * L.d_n, 1.0f, d, reinterpret_cast<bf16_bits*>(dv_out + t * bp.dv_strides[2]));
    }
  }
  // With key chunks: this run's dQᵀ joins the kv head's sum once runs 0 .. chunk − 1 have joined theirs, so every sum
  // is ((dQᵀ_0 + dQᵀ_1) + dQᵀ_2) + ..., whatever thread ran which run and when; the last run writes dq from it.
  const float* dQT = s.dQT;
  if (L.chunks > 1) {
    const int64_t dq_size = L.group_size * L.d_k * L.dqt_ld, pair = b * p.num_kv_heads + kvh;
    float* sum = s.workspace + L.dq_sums + (L.pair_major ? 0 : pair) * dq_size;
    key_runs::wait_for_turn(s.workspace, pair, chunk);
    for (int64_t g = 0; g < L.group_size; ++g)
      for (int64_t e = 0; e < d; ++e) {
        float* to = sum + (g * L.d_k + e) * L.dqt_ld;
        const float* part = s.dQT + (g * L.d_k + e) * L.dqt_ld;
        if (chunk == 0)
          std::copy(part, part + p.q_len, to);
        else
          for (int64_t i = 0; i < p.q_len; ++i) to[i] += part[i];
      }
    key_runs::end_turn(s.workspace, pair, chunk);
    if (chunk < L.chunks - 1) return;
    dQT = sum;
  }
  for (int64_t g = 0; g < L.group_size; ++g) {  // dQ = scale · (dQᵀ)ᵀ
    auto* dq_out = static_cast<c10::BFloat16*>(bp.dq) + b * bp.dq_strides[0] + (h0 + g) * bp.dq_strides[1];
    store_transposed_scaled_bf16(dQT + g * L.d_k * L.dqt_ld, L.dqt_ld, d, p.q_len, p.scale,
                                 reinterpret_cast<bf16_bits*>(dq_out), bp.dq_strides[2]);
  }
}

void run(const AttentionBackwardParams& bp, float* ws) {
  const AttentionParams& p = bp.fwd;
  const Layout L(bp);
  if (L.chunks > 1) key_runs::reset(ws, L.pairs);
#pragma omp parallel num_threads(static_cast<int>(L.threads))
  {
    const Scratch s(L, ws + L.shared + omp_get_thread_num() * L.per_thread, ws);
    const DotScope tiles;  // AMX: our tile configuration for this thread, the previous one restored after
    const auto task = [&](int64_t t) {
      const int64_t pair = L.pair_major ? t / L.chunks : t % L.pairs, chunk = L.pair_major ? t % L.chunks : t / L.pairs;
      const int64_t b = pair / p.num_kv_heads;  // packed sequences: the task reads sequence b as a call of its own
      kv_head_task(sequence_view(bp, b), L, b, pair % p.num_kv_heads, chunk, s);
    };
    if (L.chunks == 1) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < L.tasks; ++t) task(t);
    } else {
      key_runs::take_in_order(ws, L.tasks, task);
    }
  }
}

// bf16 inputs on the one-pass path (heuristics.h's choice): windows, key ranges (visible_key_range), attn_mask (a strip
// at a time) and dropout included.
inline bool applies(const AttentionBackwardParams& bp) {
  return bp.path == BackwardPath::one_pass && bp.fwd.dtype == DType::bf16;
}

inline int64_t workspace_floats(const AttentionBackwardParams& bp) {
  const Layout L(bp);
  return L.shared + L.threads * L.per_thread;
}

}  // namespace flash_backward_bf16
}  // namespace CS149_ISA
}  // namespace cs149gpt

#endif  // CS149_ISA_BF16_DOT
