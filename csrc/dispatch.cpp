// Run-time choice of the kernels' instruction set.
//
// The module carries the kernels three times (csrc/isa/): AVX-512, AVX2+FMA and portable C++. At first use
// it takes the widest one this CPU runs, unless the environment variable CS149GPT_ISA names one.
#include "attention.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace cs149gpt {
namespace {

const KernelTable* table_named(const std::string& isa) {
  if (isa == "avx512") return &avx512::kernel_table;
  if (isa == "avx2") return &avx2::kernel_table;
  if (isa == "scalar") return &scalar::kernel_table;
  throw std::invalid_argument("unknown ISA '" + isa + "': expected one of avx512, avx2, scalar");
}

const KernelTable* checked_table(const std::string& isa, const char* origin) {
  const KernelTable* table = nullptr;
  try {
    table = table_named(isa);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(origin) + ": " + e.what());
  }
  if (!cpu_supports(isa.c_str()))
    throw std::invalid_argument(std::string(origin) + " asks for ISA '" + isa + "', which this CPU does not support");
  return table;
}

const KernelTable* best_table() {
  if (const char* forced = std::getenv("CS149GPT_ISA"); forced && *forced)
    return checked_table(forced, "CS149GPT_ISA");
  for (const char* isa : {"avx512", "avx2"})
    if (cpu_supports(isa)) return table_named(isa);
  return &scalar::kernel_table;
}

std::atomic<const KernelTable*> current{nullptr};

}  // namespace

bool cpu_supports(const char* isa) {
  const std::string name = isa;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (name == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma");
  if (name == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return name == "scalar";
}

const KernelTable& kernels() {
  const KernelTable* table = current.load(std::memory_order_acquire);
  if (!table) {
    table = best_table();  // throws on a bad CS149GPT_ISA, reported at the first call
    current.store(table, std::memory_order_release);
  }
  return *table;
}

void set_isa(const char* isa) { current.store(checked_table(isa, "set_isa"), std::memory_order_release); }

}  // namespace cs149gpt
