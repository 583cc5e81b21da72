// The teaching rung of the CUDA ladder: FlashAttention's Algorithm 1, one thread per query row, float32.
//
// Read it beside the paper (and csrc/kernels/flash.cpp). A thread block holds Br query rows (one thread
// each, Q_i in shared memory) and walks the Tc key tiles; each tile K_j, V_j (Bc rows) is copied to shared
// memory by the whole block, then every thread updates its own row:
//   S_ij  = scale · Q_i K_jᵀ                  (Bc scores of this thread's row, kept in shared memory)
//   m~_ij = rowmax(S_ij);  P~_ij = exp(S_ij − m~_ij);  l~_ij = rowsum(P~_ij)
//   m_new = max(m_i, m~_ij);  l_new = e^{m_i − m_new} l_i + e^{m~_ij − m_new} l~_ij
//   O_i   = (l_i e^{m_i − m_new} O_i + e^{m~_ij − m_new} P~_ij V_j) / l_new      (O_i lives in `out`)
//   m_i = m_new;  l_i = l_new
// and lse_i = m_i + log l_i at the end. No tensor cores, no tricks: the fast version is flash_fwd.cuh.
#include <cmath>

#include "flash_common.cuh"
#include "flash_cuda.h"

namespace cs149gpt {
namespace cuda {
namespace {

__global__ void flash_teaching_kernel(const AttentionParams params) {
  const int Br = static_cast<int>(params.block_q), Bc = static_cast<int>(params.block_k);
  const int d = static_cast<int>(params.head_dim);
  extern __shared__ float smem_f[];
  float* Qi = smem_f;          // Br x d
  float* Kj = Qi + Br * d;     // Bc x d
  float* Vj = Kj + Bc * d;     // Bc x d
  float* Sij = Vj + Bc * d;    // Br x Bc

  const int64_t b = blockIdx.y / params.num_heads, h = blockIdx.y % params.num_heads;
  const AttentionParams p = sequence_view(params, b);  // packed sequences: sequence b as a call of its own
  if (static_cast<int64_t>(blockIdx.x) * Br >= p.q_len) return;
  const int64_t hk = h / (p.num_heads / p.num_kv_heads);
  const int tid = threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * Br + tid;  // this thread's query row
  const bool has_row = i < p.q_len;

  const float* Q = head_ptr(static_cast<const float*>(p.q), p.q_strides, b, h);
  const float* K = head_ptr(static_cast<const float*>(p.k), p.k_strides, b, hk);
  const float* V = head_ptr(static_cast<const float*>(p.v), p.v_strides, b, hk);
  float* O = head_ptr(static_cast<float*>(p.out), p.out_strides, b, h);

  for (int x = 0; x < d; ++x) {
    Qi[tid * d + x] = has_row ? Q[i * p.q_strides[2] + x] : 0.f;
    if (has_row) O[i * p.out_strides[2] + x] = 0.f;
  }
  float m_i = -INFINITY, l_i = 0.f;

  const int64_t Tc = (p.kv_len + Bc - 1) / Bc;
  for (int64_t j = 0; j < Tc; ++j) {
    __syncthreads();  // everyone is done with the previous K_j, V_j
    for (int idx = tid; idx < Bc * d; idx += Br) {
      const int64_t key = j * Bc + idx / d;
      Kj[idx] = key < p.kv_len ? K[key * p.k_strides[2] + idx % d] : 0.f;
      Vj[idx] = key < p.kv_len ? V[key * p.v_strides[2] + idx % d] : 0.f;
    }
    __syncthreads();
    if (!has_row) continue;

    // S_ij = scale · Q_i K_jᵀ, masked; m~_ij = rowmax.
    float m_ij = -INFINITY;
    bool nan_seen = false;  // fmaxf skips a NaN: kept apart, so that it turns the row NaN (README's rule)
    for (int c = 0; c < Bc; ++c) {
      float s = -INFINITY;
      if (key_visible(p, i, j * Bc + c)) {
        s = 0.f;
        for (int x = 0; x < d; ++x) s += Qi[tid * d + x] * Kj[c * d + x];
        s *= p.scale;
      }
      Sij[tid * Bc + c] = s;
      m_ij = fmaxf(m_ij, s);
      nan_seen |= s != s;
    }
    if (nan_seen) m_ij = NAN;
    if (m_ij == -INFINITY) continue;  // this row sees no key of the tile

    // P~_ij = exp(S_ij − m~_ij); l~_ij = rowsum.
    float l_ij = 0.f;
    for (int c = 0; c < Bc; ++c) {
      const float p_ic = expf(Sij[tid * Bc + c] - m_ij);
      Sij[tid * Bc + c] = p_ic;
      l_ij += p_ic;
    }

    const float m_new = fmaxf(m_i, m_ij);
    const float old_weight = l_i * expf(m_i - m_new), new_weight = expf(m_ij - m_new);  // expf(-inf) = 0
    const float l_new = old_weight + new_weight * l_ij;
    // O_i = (l_i e^{m_i − m_new} O_i + e^{m~_ij − m_new} P~_ij V_j) / l_new
    for (int x = 0; x < d; ++x) {
      float pv = 0.f;
      for (int c = 0; c < Bc; ++c) pv += Sij[tid * Bc + c] * Vj[c * d + x];
      float& o = O[i * p.out_strides[2] + x];
      o = (old_weight * o + new_weight * pv) / l_new;
    }
    m_i = m_new;
    l_i = l_new;
  }
  if (has_row && p.lse != nullptr)
    p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + i] = l_i == 0.f ? -INFINITY : m_i + logf(l_i);
}

}  // namespace

size_t teaching_smem_bytes(const AttentionParams& p) {
  return sizeof(float) * static_cast<size_t>((p.block_q + 2 * p.block_k) * p.head_dim + p.block_q * p.block_k);
}

cudaError_t flash_teaching_fwd(const AttentionParams& p, cudaStream_t stream) {
  const size_t smem = teaching_smem_bytes(p);
  cudaError_t err = cudaFuncSetAttribute(flash_teaching_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((p.q_len + p.block_q - 1) / p.block_q),
                  static_cast<unsigned>(p.batch * p.num_heads));
  flash_teaching_kernel<<<grid, static_cast<unsigned>(p.block_q), smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace cs149gpt
