// AMX tiles in software: the tile intrinsics the amx kernels use, done with plain loops over a per-thread copy of
// the tile registers, so that the same kernel sources (kernels_amx_emulated.cpp) run — slowly — on a CPU without
// AMX. It exists for testing: most development machines and CI have no AMX, and without it the AMX code paths (tile blocking,
// VNNI layouts, the configuration saved, loaded and released around each use — and put back when another library,
// oneDNN, had one: amx_emulated::restores_tile_config, tests/test_flash.py) would be checked only on AMX hardware.
// Never chosen automatically; CS149GPT_ISA=amx_emulated or set_isa("amx_emulated") asks for it.
//
// What it follows, from Intel's description of the instructions (SDM, "Intel AMX"):
//   ldtilecfg / sttilecfg  palette 1: per tile, rows (≤ 16) and bytes a row (colsb ≤ 64); palette 0 = nothing
//                          configured (what sttilecfg reports then, and what tilerelease returns to);
//   tileloadd              rows × colsb bytes from base + row · stride; the rest of the tile zeroed;
//   tilestored             rows × colsb bytes to base + row · stride;
//   tdpbf16ps C, A, B      C[m][n] += A[m][2k]·B[k][2n] + A[m][2k+1]·B[k][2n+1] over the pairs k, in float32,
//                          bf16 inputs that are subnormal read as zero, a subnormal result flushed to zero.
// Misuse the hardware would fault on (no configuration, shapes that do not agree) aborts with a message; not checked:
// the configuration's reserved bytes, its start row, colsb a multiple of 4 for tdpbf16ps (our TileConfig zeroes the
// first two and uses 64-byte rows). The tile products are not the hardware's bit for bit: against a 16-core Xeon's AMX,
// 0.03–1 % of the outputs differ, so tests compare with tolerances, as they do anyway.
// Every AMX intrinsic this file does not replace is undefined at its end: GCC's tile macros expand to inline asm,
// which the compiler would emit whatever the target, so a kernel that used one would fault on a CPU without AMX —
// with the macro undefined it does not compile instead.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>  // (kernels_amx_emulated.cpp includes these first, under the default target)

namespace cs149gpt {
namespace amx_emulation {

struct Tiles {
  uint8_t palette = 0;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) unsigned char data[8][16][64] = {};
};
inline thread_local Tiles tiles;

[[noreturn]] inline void fault(const char* what) {
  std::fprintf(stderr, "amx_emulation: %s (the hardware would fault)\n", what);
  std::abort();
}

inline void check_tile(int t) {
  if (tiles.palette != 1) fault("tile instruction with no tile configuration loaded");
  if (t < 0 || t >= 8 || tiles.rows[t] == 0) fault("tile register not configured");
}

// The 64-byte configuration: byte 0 palette, byte 1 start row, bytes 16–31 colsb of tiles 0–7 (uint16), bytes
// 48–55 rows of tiles 0–7.
inline void loadconfig(const void* config) {
  const auto* c = static_cast<const unsigned char*>(config);
  Tiles fresh;
  fresh.palette = c[0];
  if (fresh.palette > 1) fault("unknown tile palette");
  if (fresh.palette == 1)
    for (int t = 0; t < 8; ++t) {
      std::memcpy(&fresh.colsb[t], c + 16 + 2 * t, 2);
      fresh.rows[t] = c[48 + t];
      if (fresh.rows[t] > 16 || fresh.colsb[t] > 64 || (fresh.rows[t] == 0) != (fresh.colsb[t] == 0))
        fault("tile shape beyond palette 1's 16 rows of 64 bytes");
    }
  tiles = fresh;
}

inline void storeconfig(void* config) {
  auto* c = static_cast<unsigned char*>(config);
  std::memset(c, 0, 64);
  if (tiles.palette == 0) return;
  c[0] = tiles.palette;
  for (int t = 0; t < 8; ++t) {
    std::memcpy(c + 16 + 2 * t, &tiles.colsb[t], 2);
    c[48 + t] = tiles.rows[t];
  }
}

inline void release() { tiles = Tiles{}; }

inline void zero(int t) {
  check_tile(t);
  std::memset(tiles.data[t], 0, sizeof tiles.data[t]);
}

inline void loadd(int t, const void* base, int64_t stride) {
  check_tile(t);
  zero(t);
  for (int r = 0; r < tiles.rows[t]; ++r)
    std::memcpy(tiles.data[t][r], static_cast<const unsigned char*>(base) + r * stride, tiles.colsb[t]);
}

inline void stored(int t, void* base, int64_t stride) {
  check_tile(t);
  for (int r = 0; r < tiles.rows[t]; ++r)
    std::memcpy(static_cast<unsigned char*>(base) + r * stride, tiles.data[t][r], tiles.colsb[t]);
}

// A bf16 (bits) as float32, subnormals as zero (DAZ).
inline float bf16_daz(uint16_t bits) {
  const uint32_t wide = (bits & 0x7F80u) == 0 ? (bits & 0x8000u) << 16 : static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

inline float flush_subnormal(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline void dpbf16ps(int c, int a, int b) {
  check_tile(c), check_tile(a), check_tile(b);
  const int M = tiles.rows[c], N = tiles.colsb[c] / 4, K = tiles.colsb[a] / 4;
  if (tiles.rows[a] != M || tiles.rows[b] != K || tiles.colsb[b] != tiles.colsb[c])
    fault("tdpbf16ps operand shapes do not agree");
  for (int m = 0; m < M; ++m) {
    float acc[16];
    std::memcpy(acc, tiles.data[c][m], sizeof acc);
    uint16_t arow[32], brow[32];
    std::memcpy(arow, tiles.data[a][m], sizeof arow);
    for (int k = 0; k < K; ++k) {
      std::memcpy(brow, tiles.data[b][k], sizeof brow);
      const float a0 = bf16_daz(arow[2 * k]), a1 = bf16_daz(arow[2 * k + 1]);
      for (int n = 0; n < N; ++n) {
        acc[n] = flush_subnormal(acc[n] + a0 * bf16_daz(brow[2 * n]));
        acc[n] = flush_subnormal(acc[n] + a1 * bf16_daz(brow[2 * n + 1]));
      }
    }
    std::memset(tiles.data[c][m], 0, 64);
    std::memcpy(tiles.data[c][m], acc, 4 * N);
  }
}

}  // namespace amx_emulation
}  // namespace cs149gpt

// The intrinsics' names, as the kernels call them (GCC defines most as macros, the configuration ones as functions).
#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
// Not emulated: undefined, so that a use does not compile (above).
#undef _tile_loadd_internal
#undef _tile_stream_loadd_internal
#undef _tile_stored_internal
#undef _tile_zero_internal
#undef _tile_dpbf16ps_internal
#undef _tile_dpbssd
#undef _tile_dpbsud
#undef _tile_dpbusd
#undef _tile_dpbuud
#undef _tile_int8_dp_internal
#undef _tile_dpfp16ps
#undef _tile_dpfp16ps_internal
#undef _tile_cmmimfp16ps
#undef _tile_cmmrlfp16ps
#undef _tile_cmmimfp16ps_internal
#undef _tile_cmmrlfp16ps_internal
#define _tile_loadd(t, base, stride) ::cs149gpt::amx_emulation::loadd(t, base, stride)
#define _tile_stream_loadd(t, base, stride) ::cs149gpt::amx_emulation::loadd(t, base, stride)
#define _tile_stored(t, base, stride) ::cs149gpt::amx_emulation::stored(t, base, stride)
#define _tile_zero(t) ::cs149gpt::amx_emulation::zero(t)
#define _tile_dpbf16ps(c, a, b) ::cs149gpt::amx_emulation::dpbf16ps(c, a, b)
#define _tile_loadconfig(config) ::cs149gpt::amx_emulation::loadconfig(config)
#define _tile_storeconfig(config) ::cs149gpt::amx_emulation::storeconfig(config)
#define _tile_release() ::cs149gpt::amx_emulation::release()
