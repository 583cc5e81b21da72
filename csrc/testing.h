// The module's testing corner (testing.cpp): cs149gpt._C._testing.
#pragma once

#include <pybind11/pybind11.h>

#include "heuristics.h"

namespace cs149gpt {
namespace testing {

// The backward's path, key chunks and head parts as forced by _testing.set_backward_* (default: by shape).
extern heuristics::BackwardForce backward_force;

// Adds the submodule _testing to the module m.
void register_testing(pybind11::module_& m);

}  // namespace testing
}  // namespace cs149gpt
