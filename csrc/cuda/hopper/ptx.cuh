// The Hopper (sm_90a) instructions of the warp-specialized kernels, one small wrapper each: the only place with their
// inline PTX. The algorithms (flash_fwd_hopper.cuh, flash_bwd_hopper.cuh) call these by name.
//
//   mbarrier            shared-memory barriers that count arrivals and, with expect_tx, bytes the copy engine delivers
//   cp.async.bulk.tensor  the copy engine (TMA): a box of a tensor map, global -> shared, completing on an mbarrier
//   cp.async.bulk       the same engine's plain copy of contiguous bytes
//   cp.reduce.async.bulk.tensor  the copy engine adding a shared-memory box into a tensor map's box (float32 dQ)
//   wgmma.mma_async     a warpgroup's (4 warps, 128 threads) asynchronous matrix product, accumulators in registers
//   setmaxnreg          moves registers between warpgroups (the producer gives, the consumers take)
//   fence.proxy.async   orders ordinary shared-memory accesses against the copy engine's and the tensor cores'
//
// Every function here is used only inside the sm_90a guard of the kernels; the sm_80 pass never emits them.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: nothing is linked from the driver)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace cs149gpt {
namespace cuda {
namespace hopper {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// ---- mbarrier ------------------------------------------------------------------------------------------------------
// A barrier completes a phase when `count` arrivals and every byte announced by expect_tx have come; phases alternate
// parity 0, 1, 0, ... Waiting on parity P returns once the phase of parity P before the current one has completed
// (the current phase has parity P ^ 1); on a fresh barrier (phase 0 running) waiting on parity 1 returns at once,
// which is how a producer finds every buffer empty at start.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the copy engine and the other threads (before the block's barrier).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival, announcing `bytes` more that the copy engine will deliver to this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Announces `bytes` more for the current phase without arriving (an arrival later completes it with them).
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// ---- the copy engine (TMA) -------------------------------------------------------------------------------------------
// Copies the box of `map` whose first element is at coordinates (c0, c1, c2, c3), innermost first, into shared memory
// at dst (1024-byte aligned for the 128-byte swizzle); the bytes complete on `bar`. Elements past the tensor's bounds
// arrive as zeros and count as delivered bytes all the same.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(smem_u32(bar))
      : "memory");
}
// Copies `bytes` contiguous bytes (a multiple of 16; src and dst 16-byte aligned) from global to shared memory with the
// copy engine, completing on `bar` like a tensor copy.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
// Adds the box of shared memory at src (1024-byte aligned, laid out as tma_load_4d writes it) into the box of `map` at
// (c0, c1, c2, c3), element by element, with the copy engine (float32 maps: dQ's accumulator); elements past the
// tensor's bounds are dropped. Asynchronous: the reduction joins this thread's open bulk group (bulk_commit_group).
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2,
                                                  int c3) {
  asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(src))
               : "memory");
}
// Closes this thread's bulk copies to global memory issued so far into a group.
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's bulk groups are still reading their shared-memory source (the source may then
// be overwritten).
template <int N> __device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until at most N of this thread's bulk groups are pending at all (before the block exits).
template <int N> __device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- ordering and registers -------------------------------------------------------------------------------------------
// Orders this thread's ordinary shared-memory accesses before later accesses of the async proxy (TMA, wgmma), and
// theirs before this thread's later ones.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The same between ordinary global-memory accesses and the async proxy's (bulk tensor reductions).
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
// A barrier among `threads` threads (a multiple of 32) under id 1..15 (0 is __syncthreads').
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Counts the calling threads towards barrier `id` without waiting (the producer side of a bar.sync on it).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Every warp of a warpgroup executes the same one; takes effect only under a register cap at entry
// (__launch_bounds__(threads, 1)).
template <int kRegs> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- exponentials on the FMA pipe ------------------------------------------------------------------------------------
// 2^x for x <= 0 without the MUFU unit: x = n + f (n = round(x) by the 1.5·2^23 shift, |f| <= 1/2), 2^f by its
// degree-4 Taylor polynomial in f·ln2 (relative error under 6e-5, below a 16-bit rounding), n added to the exponent
// bits. x is clamped at -126, where the result (about 1e-38) stands for 0.
__device__ __forceinline__ float exp2_poly(float x) {
  constexpr float kShift = 12582912.f;  // 1.5·2^23: x + kShift holds round(x) in its low mantissa bits
  x = fmaxf(x, -126.f);
  const float t = x + kShift;
  const float f = x - (t - kShift);
  float p = 9.6181291e-3f;        // ln2^4 / 4!
  p = fmaf(p, f, 5.5504109e-2f);  // ln2^3 / 3!
  p = fmaf(p, f, 0.24022651f);    // ln2^2 / 2!
  p = fmaf(p, f, 0.69314718f);    // ln2
  p = fmaf(p, f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// ---- wgmma: shared-memory matrix descriptors -------------------------------------------------------------------------
// A 64-bit descriptor of an operand tile in shared memory, 128-byte swizzle (the layout TMA's
// CU_TENSOR_MAP_SWIZZLE_128B writes: rows of 128 bytes, 8-row atoms of 1024 bytes, the 16-byte chunk c of row r stored
// at chunk c ^ (r % 8); atoms 1024-byte aligned, so the base offset field is 0):
//   bits  0-13  start address >> 4        bits 16-29  leading byte offset >> 4
//   bits 32-45  stride byte offset >> 4   bits 62-63  swizzle mode (1 = 128-byte)
// K-major operand (rows along M or N, 64 k-values per 128-byte row): the stride byte offset is the distance between
// 8-row atoms (1024 when they are stacked); the leading offset is unused under a swizzle (1 by convention). The k-th
// step of 16 values starts 32·k bytes into the row: the start address moves, the swizzle is applied by the hardware
// to the final address, as TMA applied it.
// MN-major operand (rows along K, 64 values of N per 128-byte row; wgmma's transposed mode): the stride byte offset
// is the distance between atoms of 8 K-rows (1024), the leading byte offset the distance between the 64-column panels
// of N (the tile's rows x 128 bytes).
__device__ __forceinline__ uint64_t smem_desc_sw128(const void* tile, uint32_t leading_bytes, uint32_t stride_bytes) {
  const uint64_t addr = smem_u32(tile);
  return ((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
// The descriptor of the same tile `bytes` further on (a k-step, a panel): only the start address field moves, and it
// never carries out of its 14 bits (shared memory addresses are below 2^18), so one 32-bit add of a constant does it.
// Building every k-step's descriptor from its address instead costs ~10 dependent instructions between two wgmmas: with
// the descriptors in uniform registers (a warp-uniform warpgroup index), a consumer warp's unmasked step of the d 128
// backward is 559 SASS instructions instead of 856, and the backward 3-8 % faster on an H200.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// ---- wgmma: issue, commit, wait -------------------------------------------------------------------------------------
// wgmma_fence before the first wgmma of a batch: the registers it reads (accumulators, A fragments) were written by
// ordinary instructions. commit closes the batch into a group; wait<N> blocks until at most N groups are pending.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// The compiler sees a wgmma's accumulators as written when it is issued; this pins every register of a fragment at a
// point (after wgmma_wait), so no read of it moves above the wait, and keeps an A fragment alive (its registers given
// to nothing else) until the wait.
template <int N> __device__ __forceinline__ void fence_fragment(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N, int M> __device__ __forceinline__ void fence_fragment(uint32_t (&r)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < M; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// ---- wgmma: the products ----------------------------------------------------------------------------------------------
// D (64 x N, float32) = A (64 x 16) · B (16 x N) (+ D when accumulate), bf16 or fp16 operands.
// The fragment of D (and of every m64nNk16 float32 accumulator), thread `lane` of warp w (0..3) of the warpgroup,
// g = lane / 4, t = lane % 4, i = 0 .. N/2 − 1:
//   d[i] is element (row 16·w + g + 8·((i / 2) % 2), column 8·(i / 4) + 2·t + i % 2)
// i.e. for each 8-column block j: d[4j], d[4j+1] on row g, d[4j+2], d[4j+3] on row g + 8 (mma.m16n8's C per warp).
// A from registers (wgmma_rs): 4 registers of two 16-bit values, thread as above:
//   a[0] = (row g,     k 2t, 2t+1)   a[1] = (row g + 8, k 2t, 2t+1)
//   a[2] = (row g,     k 2t+8, 2t+9) a[3] = (row g + 8, k 2t+8, 2t+9)
// so the float32 accumulator of a product with N = 16·s, its values converted two at a time in order (d[8s'+0,1],
// d[8s'+2,3], d[8s'+4,5], d[8s'+6,7]), is the A operand of k-slice s' of the next product: P = softmax(S) feeds P V
// without a shuffle.
//   wgmma_ss: A and B from shared memory, both K-major (imm-trans 0, 0): S = Q Kᵀ with Q and K stored (rows, d);
//             N = 64, 128, 160, 192.
//   wgmma_rs: A from registers, B MN-major (imm-trans-b 1): O += P V with V stored (keys, d), keys being K; N = 64, 128.
//   wgmma_ss_mn: A and B from shared memory, both MN-major (imm-trans 1, 1): the backward's dQ = dS K with dS stored
//             as dSᵀ (keys, queries) and K stored (keys, d), keys being K; N = 64.
template <int N, class T> __device__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate);
template <int N, class T>
__device__ void wgmma_ss_mn(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate);
template <int N, class T>
__device__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int accumulate);

// Operand lists of the accumulator: "+f"(d[0]) ... and the matching "{%0, ...}" register lists.
#define HOPPER_WGMMA_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define HOPPER_WGMMA_OPERANDS32(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define HOPPER_WGMMA_REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define HOPPER_WGMMA_OPERANDS64(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#define HOPPER_WGMMA_REGS80 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}"
#define HOPPER_WGMMA_OPERANDS80(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])

#define HOPPER_WGMMA_REGS96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define HOPPER_WGMMA_OPERANDS96(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])

#define HOPPER_DEFINE_WGMMA(TYPE, PTX)                                                                                  \
  template <>                                                                                                          \
  __device__ __forceinline__ void wgmma_ss<64, TYPE>(float (&d)[32], uint64_t desc_a, uint64_t desc_b,                 \
                                                     int accumulate) {                                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " " HOPPER_WGMMA_REGS32                     \
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"                                                                     \
                 : HOPPER_WGMMA_OPERANDS32(d)                                                                          \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                         \
  }                                                                                                                    \
  template <>                                                                                                          \
  __device__ __forceinline__ void wgmma_ss<128, TYPE>(float (&d)[64], uint64_t desc_a, uint64_t desc_b,                \
                                                      int accumulate) {                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " " HOPPER_WGMMA_REGS64                    \
                 ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                                     \
                 : HOPPER_WGMMA_OPERANDS64(d)                                                                          \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                         \
  }                                                                                                                    \
  template <>                                                                                                          \
  __device__ __forceinline__ void wgmma_ss<160, TYPE>(float (&d)[80], uint64_t desc_a, uint64_t desc_b,                \
                                                      int accumulate) {                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n160k16.f32." PTX "." PTX " " HOPPER_WGMMA_REGS80                    \
                 ", %80, %81, p, 1, 1, 0, 0;\n}\n"                                                                     \
                 : HOPPER_WGMMA_OPERANDS80(d)                                                                          \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                         \
  }                                                                                                                    \
  template <>                                                                                                          \
  __device__ __forceinline__ void wgmma_ss<192, TYPE>(float (&d)[96], uint64_t desc_a, uint64_t desc_b,                \
                                                      int accumulate) {                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32." PTX "." PTX " " HOPPER_WGMMA_REGS96                    \
                 ", %96, %97, p, 1, 1, 0, 0;\n}\n"                                                                     \
                 : HOPPER_WGMMA_OPERANDS96(d)                                                                          \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                         \
  }                                                                                                                    \
  template <>                                                                                                          \
  __device__ __forceinline__ void wgmma_ss_mn<64, TYPE>(float (&d)[32], uint64_t desc_a, uint64_t desc_b,              \
                                                        int accumulate) {                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " " HOPPER_WGMMA_REGS32                     \
                 ", %32, %33, p, 1, 1, 1, 1;\n}\n"                                                                     \
                 : HOPPER_WGMMA_OPERANDS32(d)                                                                          \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                         \
  }                                                                                                                    \
  template <>                                                                                                          \
  __device__ __forceinline__ void wgmma_rs<64, TYPE>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,          \
                                                     int accumulate) {                                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " " HOPPER_WGMMA_REGS32                     \
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                                       \
                 : HOPPER_WGMMA_OPERANDS32(d)                                                                          \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));                          \
  }                                                                                                                    \
  template <>                                                                                                          \
  __device__ __forceinline__ void wgmma_rs<128, TYPE>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,         \
                                                      int accumulate) {                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " " HOPPER_WGMMA_REGS64                    \
                 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                                       \
                 : HOPPER_WGMMA_OPERANDS64(d)                                                                          \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));                          \
  }

HOPPER_DEFINE_WGMMA(__nv_bfloat16, "bf16")
HOPPER_DEFINE_WGMMA(__half, "f16")
#undef HOPPER_DEFINE_WGMMA

}  // namespace hopper
}  // namespace cuda
}  // namespace cs149gpt
