// Runs one instruction of a CPU feature, so that a caller can learn whether this machine executes
// it: /proc/cpuinfo lists what the CPU reports, and a virtual machine may report what it cannot
// run (AMX's tile instructions fault where the hypervisor or the kernel does not give the process
// its tile state). The caller runs it in a child process (kernels/isa.py): a feature that does not
// run kills that child with SIGILL or SIGSEGV. Registered as torch.ops.tandem.isa_probe.
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <string>

namespace {

__attribute__((target("avx512f,avx512bf16"))) float dot_bf16() {
  __m512 ones = _mm512_set1_ps(1.0f);
  __m512bh pairs = _mm512_cvtne2ps_pbh(ones, ones);
  return _mm512_reduce_add_ps(_mm512_dpbf16_ps(ones, pairs, pairs));  // 16 lanes of 1 + 1*1 + 1*1
}

// Linux hands a process AMX's tile data only once asked (arch_prctl ARCH_REQ_XCOMP_PERM); without
// that, the first tile instruction raises SIGILL, as it does for any program that never asks.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;
alignas(64) unsigned char tile_config[64];

__attribute__((target("amx-tile,amx-bf16"))) float tile_dot_bf16() {
  TORCH_CHECK(syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0,
              "the kernel refuses AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)");
  std::memset(tile_config, 0, sizeof(tile_config));
  tile_config[0] = 1;  // palette 1: 8 tiles of up to 16 rows of 64 bytes
  for (int tile = 0; tile < 3; ++tile) {
    tile_config[16 + 2 * tile] = 64;  // bytes per row (a 16-bit little-endian field)
    tile_config[48 + tile] = 16;      // rows
  }
  alignas(64) static float out[16 * 16];
  _tile_loadconfig(tile_config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];  // zeros times zeros
}

}  // namespace

double isa_probe(const std::string& feature) {
  if (feature == "avx512_bf16") return dot_bf16();
  if (feature == "amx_bf16") return tile_dot_bf16();
  if (feature == "trap") __builtin_trap();  // for the tests: a probe that faults
  TORCH_CHECK(false, "isa_probe: no probe for ", feature);
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("isa_probe(str feature) -> float", &isa_probe);
}
