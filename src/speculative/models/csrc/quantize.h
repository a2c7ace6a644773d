// Activations to int8 for the products of this folder: a span of floats at scale absmax / 127,
// rounded to nearest (even) and clamped to +-127, vectorized where the CPU allows and the same
// bytes on every instruction set. A prompt's 850 rows went through a scalar loop on one thread
// before: a fifth of a Qwen 1.5B prefill on a k-quant model.
//
// Scalar semantics that the vector code keeps: a NaN element does not raise the peak
// (std::max(peak, NaN) is peak; max_ps(NaN, peak) is peak too) and becomes -127.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "isa.h"

namespace speculative {

__attribute__((target("avx512f,avx512bw"))) inline float abs_max_avx512(const float* x, int64_t n) {
  __m512 peak = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) peak = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + k)), peak);
  float result = _mm512_reduce_max_ps(peak);
  for (; k < n; ++k) result = std::max(result, std::fabs(x[k]));
  return result;
}

__attribute__((target("avx2"))) inline float abs_max_avx2(const float* x, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 peak = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) peak = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + k), magnitude), peak);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, peak);
  float result = 0.f;
  for (float lane : lanes) result = std::max(result, lane);
  for (; k < n; ++k) result = std::max(result, std::fabs(x[k]));
  return result;
}

// The largest |x[k]| (NaNs skipped).
inline float abs_max(const float* x, int64_t n, Isa isa) {
  if (wide(isa)) return abs_max_avx512(x, n);
  if (isa != Isa::plain) return abs_max_avx2(x, n);
  float peak = 0.f;
  for (int64_t k = 0; k < n; ++k) peak = std::max(peak, std::fabs(x[k]));
  return peak;
}

inline int8_t to_int8_one(float v, float inverse) {
  return static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(v * inverse))));
}

// cvtps rounds as nearbyint does (the current rounding mode); |x * inverse| <= 127 and a bit,
// so the integer clamp matches the float one, and NaN's integer (INT_MIN) clamps to -127.
__attribute__((target("avx512f,avx512bw"))) inline void to_int8_avx512(const float* x, int64_t n, float inverse,
                                                                       int8_t* out) {
  const __m512 scale = _mm512_set1_ps(inverse);
  const __m512i high = _mm512_set1_epi32(127), low = _mm512_set1_epi32(-127);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), scale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                     _mm512_cvtepi32_epi8(_mm512_max_epi32(_mm512_min_epi32(v, high), low)));
  }
  for (; k < n; ++k) out[k] = to_int8_one(x[k], inverse);
}

__attribute__((target("avx2"))) inline void to_int8_avx2(const float* x, int64_t n, float inverse, int8_t* out) {
  const __m256 scale = _mm256_set1_ps(inverse);
  const __m256i high = _mm256_set1_epi32(127), low = _mm256_set1_epi32(-127);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256i v = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), scale)),
                                                        high), low);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), _mm_packs_epi16(words, words));
  }
  for (; k < n; ++k) out[k] = to_int8_one(x[k], inverse);
}

// out[k] = x[k] * inverse, rounded to nearest and clamped to +-127.
inline void to_int8(const float* x, int64_t n, float inverse, int8_t* out, Isa isa) {
  if (wide(isa)) return to_int8_avx512(x, n, inverse, out);
  if (isa != Isa::plain) return to_int8_avx2(x, n, inverse, out);
  for (int64_t k = 0; k < n; ++k) out[k] = to_int8_one(x[k], inverse);
}

// Rows in one thread's share of a quantization of M rows of K columns: whole rows, and enough
// work per share that a decoding step's one row stays on the calling thread.
inline int64_t quantize_grain(int64_t K) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1)); }

}  // namespace speculative
