// The instruction sets the kernels of this folder run on, chosen at run time (the library is
// compiled without -march, so that it runs on any x86 CPU). Every set gives the same bits.
#pragma once

#include <c10/util/Exception.h>

#include <string>

namespace speculative {

enum class Isa : int64_t { plain = 0, avx2 = 1, vnni = 2 };

inline Isa best_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) return Isa::vnni;
    if (__builtin_cpu_supports("avx2")) return Isa::avx2;
    return Isa::plain;
  }();
  return isa;
}

// "auto" (the best here), "plain", "avx2" or "vnni"; an error names what this CPU lacks.
inline Isa isa_named(const std::string& name, const char* op) {
  const Isa best = best_isa();
  if (name == "auto") return best;
  if (name == "plain") return Isa::plain;
  if (name == "avx2") {
    TORCH_CHECK(best != Isa::plain, op, ": this CPU has no AVX2");
    return Isa::avx2;
  }
  if (name == "vnni") {
    TORCH_CHECK(best == Isa::vnni, op, ": this CPU has no AVX512-VNNI");
    return Isa::vnni;
  }
  TORCH_CHECK(false, op, ": unknown instruction set '", name, "'; allowed: auto, plain, avx2, vnni");
}

inline std::string isa_name(Isa isa) {
  return isa == Isa::vnni ? "vnni" : isa == Isa::avx2 ? "avx2" : "plain";
}

}  // namespace speculative
