// AMX tiles (variant 3), shared by the kernels that use them (linear_bf16.cpp, attention.cpp):
// the tile configuration's layout and Linux's once-per-process grant of tile state.
#pragma once

#if OVERLAP_VARIANT == 3
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace overlap {

// The 64-byte operand of ldtilecfg (palette 1): bytes per row and rows of each tile register.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// Linux hands out AMX tile state only on request, once per process.
inline bool amx_permitted() {
  static const bool granted = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

}  // namespace overlap
#endif
