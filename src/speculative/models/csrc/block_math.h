// The float arithmetic that the compiled decoder blocks share (block_ops.cpp: norms and
// SwiGLU's gate; attention.cpp), written so that every instruction set gives the same bits:
// reductions in 16 lanes (element i into lane i % 16, then a fixed tree), which the compiler
// vectorizes without reordering, and an exp from plain float operations.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace speculative {

constexpr int kLanes = 16;

// Sum of a[i] * b[i] (or of a[i] * a[i] when b == a), i < n, in kLanes lanes then a fixed tree.
inline float lane_dot(const float* a, const float* b, int64_t n) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += a[i + j] * b[i + j];
  for (int j = 0; i + j < n; ++j) lane[j] += a[i + j] * b[i + j];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  return lane[0];
}

// exp(x) as Cephes' expf computes it (x = n ln 2 + r, a polynomial of degree 6 in r, 2^n from the
// exponent bits), within 2 ulp; in plain float operations, which the compiler vectorizes without
// changing a bit. Arguments are clamped to [-87, 88] (NaN to -87): the results stay normal.
// SwiGLU's gate and attention's softmax use it (libm's expf, one call per score, was a fifth of
// a long prompt's attention).
inline float exp_poly(float x) {
  x = std::min(88.f, std::max(-87.f, x));
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // x log2(e) rounded (|.| < 2^22)
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * (r * r) + r) + 1.f;
  return y * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace speculative
