// AVX2 building blocks of the block products (kquant_matmul.cpp, q32_matmul.cpp,
// int8_matmul.cpp), each with its AVX-VNNI form: the same exact integer sums in fewer
// instructions where the CPU has VEX-encoded VNNI (Intel from Alder Lake, Zen 5). The VNNI forms
// are written as assembly so that one function, compiled for AVX2 alone, holds both: a
// function compiled with the avxvnni target could be given VNNI instructions anywhere.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace speculative {

// acc + (a * b summed by pairs of 16-bit lanes): vpmaddwd and vpaddd, or one vpdpwssd.
template <bool VNNI>
__attribute__((target("avx2"), always_inline)) inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
  if constexpr (VNNI) {
    asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
    return acc;
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
  }
}

// acc + (unsigned bytes u times signed bytes s, summed by fours into 32-bit lanes): vpdpbusd.
// Only with VNNI: AVX2's vpmaddubsw saturates where two products pass 2^15.
__attribute__((target("avx2"), always_inline)) inline __m256i dpbusd_vex(__m256i acc, __m256i u, __m256i s) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
  return acc;
}

// Four bytes of a row, broadcast to every 32-bit lane.
__attribute__((target("avx2"), always_inline)) inline __m256i broadcast4(const int8_t* at) {
  int32_t v;
  std::memcpy(&v, at, 4);
  return _mm256_set1_epi32(v);
}

// A 16-bit lane pair (low, high) of every 32-bit lane made (low, low) or (high, high): a
// scale that then multiplies both 16-bit sums of a lane in one vpmaddwd.
__attribute__((target("avx2"), always_inline)) inline __m256i both_halves(__m256i pairs, bool high) {
  return high ? _mm256_or_si256(_mm256_srli_epi32(pairs, 16), _mm256_andnot_si256(_mm256_set1_epi32(0xFFFF), pairs))
              : _mm256_or_si256(_mm256_slli_epi32(pairs, 16), _mm256_and_si256(_mm256_set1_epi32(0xFFFF), pairs));
}

}  // namespace speculative
