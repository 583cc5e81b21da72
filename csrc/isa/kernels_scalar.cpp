// The attention kernels compiled for portable C++ (no ISA assumed).
//
// Standard and intrinsic headers come first, under the default target, so that inline code from them
// is never compiled for a wider ISA than the CPU may have; only the kernels below the pragma are.
#include <algorithm>
#include <cmath>
#include <cstdint>
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

// No target pragma: the baseline x86-64 (or any other CPU) the module is built for.
#define CS149_ISA scalar
#define CS149_ISA_SCALAR
#include "all_kernels.inc"
