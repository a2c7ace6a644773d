// The outer loop of the GGUF blocks' products (kquant_matmul.cpp, q32_matmul.cpp): output rows
// by groups of 16, input rows by passes of up to TOKENS, each (pass, group) one tile of sums,
// written to y (M, N) with the bias. Each pass goes over kGroupsTogether groups in turn, whose
// weights stay in the caches while the pass's activations are read once for all of them (a
// prompt's rows read once per group had made 850 rows twice as slow). Every output element is
// one tile's sum: the order of groups and passes changes no bit.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace speculative {

constexpr int64_t kGroupsTogether = 8;

// x (..., K) as contiguous rows (M, K), and the product's output y (..., N), uninitialized.
inline std::pair<at::Tensor, at::Tensor> rows_and_output(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return {x.reshape({-1, x.size(-1)}).contiguous(), at::empty(shape, x.options())};
}

// tile(m0, tokens, g, sums): the sums (tokens, 16) of input rows m0.. against group g.
template <int TOKENS, class Tile>
void over_groups(int64_t M, int64_t N, int64_t pass, const float* bias, float* y, const Tile& tile) {
  constexpr int64_t kGroup = 16;
  at::parallel_for(0, (N + kGroup - 1) / kGroup, kGroupsTogether, [&](int64_t begin, int64_t end) {
    float sums[TOKENS * kGroup];
    for (int64_t first = begin; first < end; first += kGroupsTogether)
      for (int64_t m0 = 0; m0 < M; m0 += pass) {
        const int tokens = static_cast<int>(std::min<int64_t>(pass, M - m0));
        for (int64_t g = first; g < std::min(end, first + kGroupsTogether); ++g) {
          tile(m0, tokens, g, sums);
          // Loops without a branch inside, which the compiler vectorizes (a tenth of a prompt's
          // products went to this copy element by element).
          const int64_t n0 = g * kGroup, width = std::min(kGroup, N - n0);
          for (int t = 0; t < tokens; ++t) {
            const float* sum = sums + t * kGroup;
            float* row = y + (m0 + t) * N + n0;
            if (bias)
              for (int64_t r = 0; r < width; ++r) row[r] = sum[r] + bias[n0 + r];
            else
              std::copy(sum, sum + width, row);
          }
        }
      }
  });
}

}  // namespace speculative
