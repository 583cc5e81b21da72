// The amx kernels (kernels_amx.cpp) with the AMX tile instructions done in software (amx_emulation.h), for testing
// the AMX code paths on CPUs without AMX: AVX-512 with AVX512-BF16 is all it needs. Never chosen automatically
// (dispatch.cpp); CS149GPT_ISA=amx_emulated or set_isa("amx_emulated") asks for it. Its tile products are plain
// loops (bf16 attention 10–40× slower than the avx512_bf16 kernels on a 2-core EPYC): for tests at small shapes, not
// for timing — its bf16 dot-product probe measures the emulation.
//
// Standard and intrinsic headers come first, under the default target, so that inline code from them
// is never compiled for a wider ISA than the CPU may have; only the kernels below the pragma are.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "../attention.h"
#include "../heuristics.h"  // before the pragma: its shared functions stay baseline x86-64

// No amx-tile / amx-bf16 here, and amx_emulation.h undefines every tile intrinsic it does not replace: a kernel that
// used one would not compile (GCC's tile macros are inline asm, which it would otherwise emit for any target).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,bmi2,f16c")
#include "amx_emulation.h"
#define CS149_ISA amx_emulated
#define CS149_ISA_AVX512
#define CS149_ISA_BF16_DOT
#define CS149_ISA_AMX
#define CS149_ISA_SPLIT_ON_TILES
#include "all_kernels.inc"

namespace cs149gpt {
namespace amx_emulated {

// For tests (testing.cpp, amx_emulation_restores_tile_config): the configuration a thread had before our tiles
// — here a foreign one, as oneDNN leaves its own — is back after a bf16 product under DotScope, and a thread that
// had none has none again. Needs a CPU that runs this file's kernels (cpu_supports("amx_emulated")).
bool restores_tile_config() {
  alignas(64) unsigned char foreign[64] = {};
  foreign[0] = 1;    // palette 1
  foreign[16] = 32;  // tile 0: 32 bytes a row (colsb, uint16 little-endian) ...
  foreign[48] = 8;   // ... and 8 rows
  bf16_bits a[32 * 32] = {}, b[32 * 32] = {};
  float c[32 * 32] = {};
  const auto product = [&] {
    DotScope scope;
    bf16_gemm(32, 32, 32, a, 32, b, 32, c, 32, false);
  };
  _tile_loadconfig(foreign);
  product();
  alignas(64) unsigned char after[64];
  _tile_storeconfig(after);
  const bool restored = std::memcmp(foreign, after, 64) == 0;
  _tile_release();
  product();
  _tile_storeconfig(after);
  const bool released = std::all_of(after, after + 64, [](unsigned char x) { return x == 0; });
  return restored && released;
}

}  // namespace amx_emulated
}  // namespace cs149gpt
