// The amx kernels (kernels_amx.cpp) with the AMX tile instructions done in software (amx_emulation.h), for testing
// the AMX code paths on CPUs without AMX: AVX-512 with AVX512-BF16 is all it needs. Never chosen automatically
// (dispatch.cpp); CS149GPT_ISA=amx_emulated or set_isa("amx_emulated") asks for it. Its tile products are plain
// loops (bf16 attention 10–40× slower than the avx512_bf16 kernels on the dev box): for tests at small shapes, not
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

// No amx-tile / amx-bf16 here, and amx_emulation.h undefines every tile intrinsic it does not replace: a kernel that
// used one would not compile (GCC's tile macros are inline asm, which it would otherwise emit for any target).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,bmi2,f16c")
#include "amx_emulation.h"
#define CS149_ISA amx_emulated
#define CS149_ISA_AVX512
#define CS149_ISA_BF16_DOT
#define CS149_ISA_AMX
#define CS149_ISA_FP16_SPLIT
#include "all_kernels.inc"
