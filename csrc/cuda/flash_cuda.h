// The CUDA kernels' entry points, as flash_api.cpp calls them: plain params structs in, no Tensor in sight.
// Each returns the CUDA error of its launches (cudaSuccess when all went well); the caller turns it into an
// exception. All work is queued on `stream`.
#pragma once

#include <cuda_runtime.h>

#include "../attention.h"

namespace cs149gpt {
namespace cuda {

// The teaching rung: one thread per query row, float32, any head_dim whose tiles fit in shared memory
// (flash_teaching.cu). Uses p.block_q x p.block_k (>= 1) as Br x Bc. Writes out and, if p.lse, lse.
size_t teaching_smem_bytes(const AttentionParams& p);
cudaError_t flash_teaching_fwd(const AttentionParams& p, cudaStream_t stream);

// FlashAttention-2 on tensor cores (sm_80+): bfloat16 / float16 in and out, float32 accumulation.
// head_dim must be one of kFastHeadDims; q, k, v, out rows 16-byte aligned (base pointers and strides
// multiples of 8 elements). Writes out and, if p.lse, lse. Packed sequences (p.cu_seqlens_q, in device memory; no
// seq_end, block_table): one launch over all, each block on its own sequence (attention.h, sequence_view).
constexpr int kFastHeadDims[] = {64, 128};
inline bool fast_path_supports(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }
cudaError_t flash_fwd(const AttentionParams& p, cudaStream_t stream);

// flash_fwd and flash_bwd take attn_mask, windows, softcap, ALiBi and dropout too (a general kernel, flash_mask.cuh).
// With attn_mask, p.key_ranges must be mask_key_bounds' triples (their key_range_strides step over triples): the
// kernels skip the key tiles outside a row's [first, end), and read the mask's entries within it only for a row that
// is not exact. mask_key_bounds: for each distinct row (b, h, i) of p.mask (batch x heads x rows of them: 1 along a
// broadcast dim), ranges[3·((b·heads + h)·rows + i)] .. + 2 = first key shown, last key shown + 1 ([0, 0) where none
// is), and 1 when the row shows exactly those keys adding nothing (boolean all true there, additive all 0), else 0.
cudaError_t mask_key_bounds(const AttentionParams& p, int64_t batch, int64_t heads, int64_t rows, int64_t* ranges,
                            cudaStream_t stream);

// FlashAttention-3's design on Hopper (hopper/): warp-specialized, TMA copies into a 2-stage shared-memory ring on
// mbarriers, wgmma products, setmaxnreg. The same calls as flash_fwd without dropout, softcap, ALiBi or a KV cache
// (both take attn_mask and windows as key spans, the backward only a boolean mask; or packed sequences without
// them);
// hopper_takes_shapes says whether the device, shapes and layout suit it (an sm_90a build on a compute capability 9.0
// GPU, q, k, v, out 16-byte aligned with strides multiples of 8 elements, scale > 0), hopper_fwd_supports whether the
// forward takes p. flash_fwd_hopper returns cudaErrorNotSupported where it does not. hopper_fwd_takes_tile_counter:
// whether the forward of p runs a persistent grid scheduled dynamically; then tile_counter is an int in device memory
// that is 0 (the caller's workspace), else it is ignored.
bool hopper_takes_shapes(const AttentionParams& p);
bool hopper_fwd_supports(const AttentionParams& p);
bool hopper_fwd_takes_tile_counter(const AttentionParams& p);
cudaError_t flash_fwd_hopper(const AttentionParams& p, cudaStream_t stream, int* tile_counter = nullptr);

// The backward's per-row statistics, a float32 workspace of bwd_row_stats_floats(p) floats: D_i = rowsum(dO_i ∘ O_i)
// in the first half, lse_i·log2(e) in the second (+inf for a row that sees no key: its P is then exp2(-inf) = 0), row
// i of (batch or sequence b, head h) at bwd_stats_row0(p, b, h) + i in each. A head's rows start 16-byte aligned, for
// the kernels' 16-byte copies: dense, (b·H + h)·q_pad (q_pad: q_len rounded up to 4); packed sequences, h·S +
// round_up(cu_seqlens_q[b], 4) + 4b with S = round_up(total_q, 4) + 4·batch, O(H·total_q) floats however long the
// longest sequence (round_up(x, 4) + round_up(y, 4) <= round_up(x + y, 4) + 4: a sequence's padded rows end before
// the next one's begin).
CS149GPT_HOST_DEVICE inline int64_t round_up4(int64_t x) { return (x + 3) / 4 * 4; }
CS149GPT_HOST_DEVICE inline int64_t bwd_stats_head_stride(const AttentionParams& p) {
  return p.cu_seqlens_q != nullptr ? round_up4(p.total_q) + 4 * p.batch : round_up4(p.q_len);
}
CS149GPT_HOST_DEVICE inline int64_t bwd_stats_half(const AttentionParams& p) {
  return (p.cu_seqlens_q != nullptr ? 1 : p.batch) * p.num_heads * bwd_stats_head_stride(p);
}
// Dense calls with attn_mask or a window add, after the two halves, the Hopper backward's table of query tiles
// (hopper/flash_bwd_hopper.cuh): for each (b, h, tile of kBwdSpanTileRows rows) an int4 {first, end, full_lo,
// full_hi}, the keys [first, end) some row of the tile sees and [full_lo, full_hi) every row sees exactly
// (flash_mask.cuh's SpanSummary of its rows' key_span). 4 floats a 64-row tile: FlashAttention-2's backward, which does not read it, is given it
// too.
constexpr int kBwdSpanTileRows = 64;
inline int64_t bwd_span_tiles(const AttentionParams& p) {
  const bool spans = p.cu_seqlens_q == nullptr && has_mask_or_window(p);
  return spans ? p.batch * p.num_heads * ((p.q_len + kBwdSpanTileRows - 1) / kBwdSpanTileRows) : 0;
}
inline int64_t bwd_row_stats_floats(const AttentionParams& p) { return 2 * bwd_stats_half(p) + 4 * bwd_span_tiles(p); }
// (packed sequences: reads cu_seqlens_q, in device memory)
CS149GPT_HOST_DEVICE inline int64_t bwd_stats_row0(const AttentionParams& p, int64_t b, int64_t h) {
  if (p.cu_seqlens_q != nullptr) return h * bwd_stats_head_stride(p) + round_up4(p.cu_seqlens_q[b]) + 4 * b;
  return (b * p.num_heads + h) * bwd_stats_head_stride(p);
}
// The rows the statistics' kernels run over, a thread group each: dense (b, h, i) for i < q_len; packed (h, t) for
// every packed row t < total_q (the sequence found from cu_seqlens_q; rows outside every sequence skipped).
CS149GPT_HOST_DEVICE inline int64_t bwd_stats_tasks(const AttentionParams& p) {
  return p.num_heads * (p.cu_seqlens_q != nullptr ? p.total_q : p.batch * p.q_len);
}

// Backward of flash_fwd. `delta`: the row statistics' workspace (above); `dq_accum` (batch, num_heads, q_len,
// head_dim) float32, contiguous, zeroed by the caller: dq = scale * dq_accum afterwards (the caller converts). Writes
// dk, dv, already scaled: summed over the query heads of each kv head's group, or with dkv_per_query_head one share
// per query head (dk, dv then have num_heads heads; the caller sums each group's). Packed sequences as flash_fwd
// (batch counts them): dq_accum is then (num_heads, total_q, head_dim), total_q = lse_strides[1], and dk, dv are
// packed like k and v.
cudaError_t flash_bwd(const AttentionBackwardParams& p, float* delta, float* dq_accum, bool dkv_per_query_head,
                      cudaStream_t stream);

// dq = scale · dq_accum (n float32, contiguous, n a multiple of 4, 16-byte aligned) written to dq in dtype (bf16 or
// f16, contiguous): the backward's last step, one pass.
cudaError_t dq_convert(const float* dq_accum, void* dq, int64_t n, float scale, DType dtype, cudaStream_t stream);

// The backward in FlashAttention-3's design on Hopper (hopper/flash_bwd_hopper.cuh), with flash_bwd's contract: the
// same workspace, dq_accum and outputs. hopper_bwd_supports: hopper_takes_shapes on p.fwd (a boolean attn_mask and
// windows as key spans, or packed sequences without them), plus lse given, dout 16-byte aligned with strides multiples of 8
// elements, dk and dv 4-byte aligned.
// flash_bwd_hopper returns cudaErrorNotSupported where it does not take p.
bool hopper_bwd_supports(const AttentionBackwardParams& p);
cudaError_t flash_bwd_hopper(const AttentionBackwardParams& p, float* delta, float* dq_accum, bool dkv_per_query_head,
                             cudaStream_t stream);


// Decoding against a KV cache (flash_decode.cu): attention_with_kvcache on CUDA. p is the call as the CPU op fills it,
// with device pointers for cache_seqlens, cache_leftpad, cache_batch_idx and block_table (read on the device only);
// k_new, v_new (if any) are appended into the caches first, by a kernel of their own. Any dtype, head_dim 64 or 128;
// q, k_new, v_new and the caches' rows 16-byte aligned (base pointers and strides multiples of 16 bytes).
struct DecodeParams {
  AttentionParams p;
  int64_t capacity = 0;    // rows a sequence's cache has: k_cache dim 2, or max_blocks x page_size (paged)
  int64_t cache_rows = 0;  // rows of a contiguous cache (dim 0), which cache_batch_idx entries are clamped to
  int rows_per_block = 1;  // query rows of one (batch, kv head) per block: 16 (tensor cores), float32 1, 2, 4 or 8
  int row_tiles = 1;       // blocks along the G x q_len rows of a (batch, kv head), each reading the keys once
  int splits = 1;          // blocks along the keys (decode_splits); > 1: partials in part_o, part_ml, then merged
  int page_shift = -1;     // paged: log2(page_size) where it is a power of two (a shift per key, not a division)
  int smem_per_block = 0;  // the device's shared memory a block may opt into (the ring's stages: launch_split)
  int device = 0;          // the device's index: launch_split raises a kernel's shared memory limit once per device
  float* part_o = nullptr;   // (batch x Hkv, splits, G x q_len, head_dim) float32
  float* part_ml = nullptr;  // (batch x Hkv, splits, G x q_len, 2) float32: m_s, l_s (base 2)
};
// Tile and split constants, each with its reason. bf16/fp16 run on tensor cores, float32 on the scalar kernel. With them
// K and V stream at 83-99 % of an H200's copy rate from 8k keys at batch >= 8 (bench.py cuda --suite decode: Hq 32,
// Hkv 8, d 128, bf16); at batch 1, 46 % at 8k keys and 70 % at 32k (a split's 2-tile ring fill and the merge: a 17 us
// step at 8k keys). Measured alternatives (before the split kernel's copy lost its per-row address arithmetic), split
// kernel and merge:
// - 2 stages, 3 blocks an SM and the splits sized for 3: batch 64 +3-4 %, batch 8 at 8k keys and batch 1 at 32k -2 %;
// - 8 warps on 128-key tiles: batch 1 +11-18 % to 8k keys, -4 % at 32k; batch 8 and 64 -2-9 %;
// - one block an SM with 4 or 6 stages: -14-44 % (fewer splits, fewer loads in flight);
// - the tile after the ring's prefetched into L2 (prefetch.global.L2, a 128-byte line a thread): -12-20 % at batch >= 8;
//   cp.async with the L2::256B prefetch hint: within 1 %.
constexpr int kDecodeThreads = 128;        // 4 warps (tensor cores: each a 16-key slice of every key tile)
constexpr int kDecodeTileRows = 16;        // rows a block on tensor cores: one m16 tile (G x q_len <= 16: K, V read once)
constexpr int kDecodeBlockKeys = 64;       // keys a tile: 16 a warp, the k of one m16n8k16 P V product
constexpr int kDecodeStages = 3;  // 2 tiles in flight while one is used (106 KiB a block at d 128; 2 where less fits)
constexpr int kDecodeBlocksPerSm = 2;      // blocks resident per SM at d 128 (106 KB of shared memory each)
constexpr int kDecodeMinSplitKeys = 256;   // 4 tiles: the ring fills before a split ends; a partial is small beside them
// Fewer splits when their last wave is this full (fewer partials). 0.95, not 0.85: B 1, 32768 keys (H200) 32 splits
// not 29, the split kernel 40.7 us not 46.1.
constexpr double kDecodeWaveEfficiency = 0.95;
constexpr int kDecodeMaxSplits = 128;      // bounds the merge's reads (128 partials a row)
constexpr int kDecodeMaxRowsPerBlock = 8;  // float32: q and O rows in registers, 8 rows x 4 columns of each, per lane
// Rows a block: kDecodeTileRows on tensor cores; float32: the G x q_len rows of a (batch, kv head) rounded up to 1,
// 2, 4 or 8 (more rows: several row tiles, each reading the keys again; a GQA group of 4 at q_len 1 is one read).
int decode_rows_per_block(const AttentionParams& p);
// Splits along the keys: the fewest whose blocks fill the waves of kDecodeBlocksPerSm per SM about as well as any count
// can, none shorter than kDecodeMinSplitKeys keys of the capacity (the lengths are on the device; a split past a
// shorter sequence's keys writes an empty partial).
int decode_splits(const AttentionParams& p, int64_t capacity, int rows_per_block, int sms);
cudaError_t flash_decode(const DecodeParams& dp, cudaStream_t stream);

// The merge of two partial results (attention.h, MergeParams; merge.cu), on any dtype of out_b.
cudaError_t merge_partial(const MergeParams& mp, cudaStream_t stream);

}  // namespace cuda
}  // namespace cs149gpt
