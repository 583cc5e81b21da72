// Timing for the standalone phase tools (amx_phases.cpp, bwd_phases.cpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>

// Seconds a call of f takes, over calls repeated for at least min_time seconds.
inline double timed_run(const std::function<void()>& f, double min_time) {
  int64_t calls = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double elapsed = 0;
  do {
    f();
    ++calls;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (elapsed < min_time);
  return elapsed / calls;
}

// After one warm call, the best of `rounds` timed runs sharing min_time (the device host is noisy: rounds > 1 keeps
// the run least disturbed).
inline double seconds_per_call(const std::function<void()>& f, double min_time = 0.25, int rounds = 1) {
  f();
  double best = timed_run(f, min_time / rounds);
  for (int round = 1; round < rounds; ++round) best = std::min(best, timed_run(f, min_time / rounds));
  return best;
}
