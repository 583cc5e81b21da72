// The merge of two partial attention results (attention.h, MergeParams): ring attention runs the flash kernel on its
// queries and one block of keys at a time, and folds each block's (out_b, lse_b) into its running (out, lse).
//
// Softmax over the union of two disjoint key sets, from each set's normalised output and logsumexp: the weights of
// the two sides are e^lse and e^lse_b, so with m = max(lse, lse_b) for range,
//
//     out = (e^(lse − m)·out + e^(lse_b − m)·out_b) / (e^(lse − m) + e^(lse_b − m)),   lse = m + log(the same sum).
//
// One pass over the rows: each row's two weights are two exps, then one multiply-add per element, out read and
// written once and out_b read once (the unfused form, a dozen elementwise torch ops, passes over out twice more).
#include "../attention.h"
#include "../heuristics.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <omp.h>

namespace cs149gpt {
namespace CS149_ISA {
namespace merge {

template <class T>
void run(const MergeParams& mp) {
  const int64_t d = mp.head_dim, total = mp.batch * mp.heads * mp.rows;
  // Threads only where each gets a share worth a parallel region's start.
  const int threads = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(mp.num_threads, total * d / heuristics::kMergeElementsPerThread)));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < total; ++i) {
    const MergeRow<T> row = merge_row<T>(mp, i);
    float c_a, c_b;
    const float lse = merge_weights(*row.lse, row.lse_b, &c_a, &c_b);
    for (int64_t j = 0; j < d; ++j) row.out[j] = row.out[j] * c_a + static_cast<float>(row.out_b[j]) * c_b;
    *row.lse = lse;
  }
}

}  // namespace merge

void merge_partial(const MergeParams& mp) {
  switch (mp.dtype) {
    case DType::f32: merge::run<float>(mp); break;
    case DType::bf16: merge::run<c10::BFloat16>(mp); break;
    case DType::f16: merge::run<c10::Half>(mp); break;
  }
}

}  // namespace CS149_ISA
}  // namespace cs149gpt
