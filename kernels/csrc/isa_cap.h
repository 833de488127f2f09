// TANDEM_CPU_ISA=avx2 (tandem.common.cpu): tandem's kernels take their AVX2 forms and refuse their
// AVX-512 ones, as on a CPU without AVX-512, whatever this one runs; for measuring what an
// AVX2-only machine gets on a larger one. The variable is read once a process.
#pragma once

#include <strings.h>

#include <cstdlib>

namespace tandem_isa {

inline bool capped_at_avx2() {
  static const bool capped = [] {
    const char* value = std::getenv("TANDEM_CPU_ISA");
    return value != nullptr && strcasecmp(value, "avx2") == 0;
  }();
  return capped;
}

// AVX-512 F and BW run here, and the cap allows them.
inline bool avx512_runs() {
  return !capped_at_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

// AVX512-BF16 runs here, and the cap allows it.
inline bool avx512_bf16_runs() { return !capped_at_avx2() && __builtin_cpu_supports("avx512bf16"); }

}  // namespace tandem_isa
