// The tensor-core micro-kernels of the CUDA flash kernels: the only place with inline PTX.
//
// sm_80+ instructions, warp-level: cp.async (global -> shared, 16 bytes, bypassing registers), ldmatrix
// (shared -> the registers of an mma fragment) and mma.sync.m16n8k16 (bf16/fp16 in, float32 accumulate).
// The algorithm (flash_fwd.cuh, flash_bwd.cuh) calls these by name and never writes PTX itself.
//
// Fragments of mma.m16n8k16 (g = lane / 4, t = lane % 4), as the PTX ISA lays them out:
//   A (16x16, row-major) 4 regs of 2 halves: a0 (row g, cols 2t,2t+1) a1 (row g+8, ..) a2 (row g, cols 2t+8,..)
//                                            a3 (row g+8, cols 2t+8,..)
//   B (16x8, k x n)      2 regs:             b0 (k 2t,2t+1, col g)  b1 (k 2t+8,2t+9, col g)
//   C (16x8, float32)    4 floats:           c0,c1 (row g, cols 2t,2t+1)  c2,c3 (row g+8, cols 2t,2t+1)
// A C fragment of S = Q Kᵀ therefore *is*, two n-tiles at a time, the A fragment of P for P V: no shuffle.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace cs149gpt {
namespace cuda {

// ---- element types ----------------------------------------------------------------------------------
template <class T> struct MmaType;
template <> struct MmaType<__nv_bfloat16> { static constexpr const char* name = "bf16"; };
template <> struct MmaType<__half> { static constexpr const char* name = "f16"; };

// Two floats rounded into one register of two 16-bit values (low half = first).
template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <class T> __device__ __forceinline__ float2 unpack2(uint32_t v);
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
template <> __device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}

// ---- cp.async: global -> shared, 16 bytes, asynchronous -------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Copies 16 bytes, or writes 16 zero bytes when !valid (rows past the end of a sequence).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
// Copies src_bytes (0..16) and zero-fills the rest of the 16 bytes.
__device__ __forceinline__ void cp_async_16_bytes(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- ldmatrix: four 8x8 matrices of 16-bit values, shared -> registers ------------------------------
// Lane l gives the address of row (l % 8) of matrix (l / 8); register i receives matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
// The same, each 8x8 matrix transposed on the way (for an operand stored k-major).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
// The same two from a 32-bit shared-memory address (smem_addr of a thread's base pointer plus a constant byte
// offset, which the compiler folds into the instruction: no 64-bit pointer arithmetic per load).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ---- mma.sync m16n8k16: C += A B, float32 accumulators --------------------------------------------
template <class T>
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16x8x16<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                           uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16x8x16<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                    uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- float32 reductions into global memory ------------------------------------------------------------
// dst[0..3] += v, one vector reduction on sm_90 (dst 16-byte aligned), four scalar atomics before it.
__device__ __forceinline__ void atomic_add4(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w)
               : "memory");
#else
  atomicAdd(dst, v.x);
  atomicAdd(dst + 1, v.y);
  atomicAdd(dst + 2, v.z);
  atomicAdd(dst + 3, v.w);
#endif
}

// A counter in global memory read with acquire semantics at GPU scope, and added to with release semantics (the
// backward's deterministic dQ order: AttentionBackwardParams::dq_tickets).
__device__ __forceinline__ int load_acquire_gpu(const int* counter) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(counter) : "memory");
  return value;
}
__device__ __forceinline__ void add_release_gpu(int* counter, int value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(counter), "r"(value) : "memory");
}
// Waits until *counter == value (acquire). (No bound with a __trap: in the Hopper backward one took the consumers from 0
// to ~1 KB of spills and serialized their wgmma.)
__device__ __forceinline__ void wait_for_turn(const int* counter, int value) {
  while (load_acquire_gpu(counter) != value) __nanosleep(32);
}

// ---- fast math -----------------------------------------------------------------------------------------
// 2^x by the special-function unit (relative error ~2^-22; ex2(-inf) = 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Max and sum across the 4 lanes of a quad (the lanes that hold one row of a C fragment).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

}  // namespace cuda
}  // namespace cs149gpt
