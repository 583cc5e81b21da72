// Run-time choice of the kernels' instruction set.
//
// The module carries the kernels five times (csrc/isa/): AVX-512 with AMX-BF16 tiles, AVX-512 with AVX512-BF16,
// AVX-512, AVX2+FMA and portable C++. At first use it takes the widest one this CPU runs, unless the
// environment variable CS149GPT_ISA names one. A sixth copy, amx_emulated (the amx kernels with the tiles done in
// software, csrc/isa/amx_emulation.h), runs wherever avx512_bf16 does and is only ever taken when named: it lets
// tests run the AMX code paths on machines without AMX.
#include "attention.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace cs149gpt {
namespace {

const char* const kIsas[] = {"amx", "avx512_bf16", "avx512", "avx2", "scalar"};  // widest first, as chosen

const KernelTable* table_named(const std::string& isa) {
  if (isa == "amx") return &amx::kernel_table;
  if (isa == "avx512_bf16") return &avx512_bf16::kernel_table;
  if (isa == "avx512") return &avx512::kernel_table;
  if (isa == "avx2") return &avx2::kernel_table;
  if (isa == "scalar") return &scalar::kernel_table;
  if (isa == "amx_emulated") return &amx_emulated::kernel_table;
  throw std::invalid_argument("unknown ISA '" + isa +
                              "': expected one of amx, avx512_bf16, avx512, avx2, scalar, amx_emulated");
}

// Linux hands out AMX's 8 KiB of tile state only to processes that ask (arch_prctl, once per process);
// without it the first tile instruction faults. Asked once; the answer is kept.
std::string amx_refusal;
bool amx_permitted() {
  static const bool permitted = [] {
#if defined(__linux__) && defined(__x86_64__)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0) return true;
    amx_refusal = "the kernel refused AMX tile data (arch_prctl(ARCH_REQ_XCOMP_PERM) failed): using avx512";
    return false;
#else
    amx_refusal = "AMX needs Linux on x86-64";
    return false;
#endif
  }();
  return permitted;
}

bool cpu_has_amx_tiles() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16");
#else
  return false;
#endif
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
  // On a CPU with AMX hardware, vdpbf16ps is no fast path (on a 16-core Xeon with AMX the avx512_bf16
  // kernels ran bf16 at a quarter of torch's speed, slower than converting to float32): if AMX itself cannot be
  // used there, avx512 is the better choice.
  const bool amx_hardware = cpu_supports("avx512_bf16") && cpu_has_amx_tiles();
  for (const char* isa : kIsas) {
    if (amx_hardware && std::string(isa) == "avx512_bf16") continue;
    if (cpu_supports(isa)) return table_named(isa);
  }
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
  if (name == "avx512_bf16") return cpu_supports("avx512") && __builtin_cpu_supports("avx512bf16");
  if (name == "amx") return cpu_supports("avx512_bf16") && cpu_has_amx_tiles() && amx_permitted();
  if (name == "amx_emulated") return cpu_supports("avx512_bf16");
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

const char* amx_unavailable_reason() { return amx_refusal.c_str(); }

void set_isa(const char* isa) { current.store(checked_table(isa, "set_isa"), std::memory_order_release); }

}  // namespace cs149gpt
