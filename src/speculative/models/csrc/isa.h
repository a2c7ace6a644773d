// The instruction sets the kernels of this folder run on, chosen at run time (the library is
// compiled without -march, so that it runs on any x86 CPU). Every set gives the same bits.
//
// Levels, lowest first: plain C++, AVX2 (with F16C, which every AVX2 CPU has), AVX-VNNI (AVX2 with VEX-encoded dpbusd: Intel client
// CPUs from Alder Lake, Zen 5), AVX512-VNNI (with AVX512BW: Zen 4 and 5, Xeons from Cascade
// Lake), AMX (int8_matmul.cpp only; amx.h). "auto" is the highest level that this CPU runs and
// that the ceiling allows: the ceiling (set_isa, from SPECULATIVE_ISA in models/isa.py) runs
// another CPU class's code on this one, to test or to measure it.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "amx.h"

namespace speculative {

enum class Isa : int64_t { plain = 0, avx2 = 1, avx_vnni = 2, avx512_vnni = 3 };
constexpr int kAmx = 4;  // the level above avx512_vnni: int8_matmul.cpp's tiles

inline const char* const kIsaNames[] = {"plain", "avx2", "avx_vnni", "avx512_vnni", "amx"};

// Whether this CPU runs a level (AVX-VNNI and AVX512-VNNI are not nested: Ice Lake has the
// second only).
inline bool cpu_runs(int level) {
  __builtin_cpu_init();
  switch (level) {
    case 0: return true;
    case 1: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case 2: return cpu_runs(1) && __builtin_cpu_supports("avxvnni");
    case 3: return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
    case 4: return amx_usable();
    default: return false;
  }
}

inline std::atomic<int>& isa_ceiling() {
  static std::atomic<int> ceiling{kAmx};
  return ceiling;
}

// The highest level at or below the ceiling that this CPU runs.
inline int best_level() {
  for (int level = isa_ceiling().load(std::memory_order_relaxed); level > 0; --level)
    if (cpu_runs(level)) return level;
  return 0;
}

// The best vector level (AMX aside) for the kernels that have no AMX path.
inline Isa best_isa() { return static_cast<Isa>(std::min<int>(best_level(), 3)); }

inline bool amx_allowed() { return best_level() == kAmx; }

inline int level_named(const std::string& name, const char* op) {
  for (int level = 0; level <= kAmx; ++level)
    if (name == kIsaNames[level]) return level;
  TORCH_CHECK(false, op, ": unknown instruction set '", name,
              "'; allowed: auto, plain, avx2, avx_vnni, avx512_vnni, amx");
}

// "auto" (the best allowed here) or a level by name; an error names what this CPU lacks.
inline Isa isa_named(const std::string& name, const char* op) {
  if (name == "auto") return best_isa();
  const int level = level_named(name, op);
  TORCH_CHECK(level < kAmx, op, ": no AMX path (allowed: auto, plain, avx2, avx_vnni, avx512_vnni)");
  TORCH_CHECK(cpu_runs(level), op, ": this CPU does not run ", name);
  return static_cast<Isa>(level);
}

inline std::string isa_name(Isa isa) { return kIsaNames[static_cast<int>(isa)]; }

// AVX-512 code where the level allows it (the kernels' avx512_vnni level implies AVX512F and BW).
inline bool wide(Isa isa) { return isa == Isa::avx512_vnni; }

// dpbusd on 256-bit registers: AVX-VNNI.
inline bool narrow_vnni(Isa isa) { return isa == Isa::avx_vnni; }

}  // namespace speculative
