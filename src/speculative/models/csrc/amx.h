// AMX (Xeons from Sapphire Rapids on): tile registers of up to 16 rows of 64 bytes, and an
// instruction that multiplies a tile of int8 rows by a tile of 4-byte column groups into
// exact int32 sums (int8_matmul.cpp; the k-quant blocks have no AMX path, dev/LOG.md, as one
// was slower than VNNI). Linux lends the tiles to a process
// that asks for them; the intrinsics came with GCC 11 and clang 12, and older compilers build
// the kernels without them.
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#if defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11
#define SPECULATIVE_AMX 1
#else
#define SPECULATIVE_AMX 0
#endif

namespace speculative {

// Whether this CPU has AMX-INT8 and Linux lent this process its tiles (asked once).
inline bool amx_usable() {
  static const bool usable = [] {
    if (!SPECULATIVE_AMX) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// The shapes of the 8 tiles (rows, bytes a row; 0 for tiles left unused), as ldtilecfg reads them.
struct alignas(64) TileShapes {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int64_t row_count, int64_t row_bytes) {
    if (row_count > 0 && row_bytes > 0)
      rows[tile] = static_cast<uint8_t>(row_count), bytes[tile] = static_cast<uint16_t>(row_bytes);
  }
};

#if SPECULATIVE_AMX
__attribute__((target("amx-tile"))) inline void amx_load(const TileShapes& shapes) {
  asm volatile("" : : "r"(&shapes) : "memory");  // the intrinsic tells the compiler it reads 8 bytes only
  _tile_loadconfig(&shapes);
}
__attribute__((target("amx-tile"))) inline void amx_release() { _tile_release(); }
#else
inline void amx_load(const TileShapes&) {}
inline void amx_release() {}
#endif

}  // namespace speculative
