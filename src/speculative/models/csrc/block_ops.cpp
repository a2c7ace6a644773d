// The float32 work of a decoder block between its quantized products, one call each: RMSNorm
// and SwiGLU's silu(gate) * up (attention: attention.cpp). For the int8 and k-quant models on
// CPUs (`decoder_only.py`, `use_compiled_blocks`), and Gemma 3's norms in every dtype.
//
// Why: a token of Qwen2.5-Coder 1.5B spends 15-20 ms outside its products when these run as
// PyTorch operations (about 200 small calls per block, a few microseconds each); one call each
// cuts that to a few milliseconds. Each output row is computed by one thread in one fixed order
// of float operations (block_math.h), so a token gets the same bits alone or among others, on
// AVX512, AVX2 and plain C++.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "block_math.h"
#include "isa.h"

namespace {

using speculative::Isa;
using speculative::exp_poly;
using speculative::lane_dot;

// y = x * (1 / sqrt(mean(x^2) + eps)) * w over one row of n.
inline void norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  const float inverse = 1.f / std::sqrt(lane_dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inverse * w[i];
}

#define NORM_ROWS(NAME, TARGET)                                                                           \
  TARGET __attribute__((flatten)) void NAME(const float* x, const float* w, float eps, int64_t n, float* y, \
                                            int64_t begin, int64_t end) {                                 \
    for (int64_t r = begin; r < end; ++r) norm_row(x + r * n, w, eps, n, y + r * n);                      \
  }

NORM_ROWS(norm_rows_avx512, __attribute__((target("avx512f"))))
NORM_ROWS(norm_rows_avx2, __attribute__((target("avx2"))))
NORM_ROWS(norm_rows_plain, )

// SwiGLU's gate: y[i] = silu(g[i]) * u[i], silu(g) = g / (1 + exp(-g)), over rows of 2n (g then u).
#define SILU_MUL_ROWS(NAME, TARGET)                                                                   \
  TARGET void NAME(const float* x, int64_t n, float* y, int64_t begin, int64_t end) {                 \
    for (int64_t r = begin; r < end; ++r) {                                                           \
      const float* g = x + r * 2 * n;                                                                 \
      const float* u = g + n;                                                                         \
      float* out = y + r * n;                                                                         \
      for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.f + exp_poly(-g[i])) * u[i];                 \
    }                                                                                                 \
  }

SILU_MUL_ROWS(silu_mul_rows_avx512, __attribute__((target("avx512f"))))
SILU_MUL_ROWS(silu_mul_rows_avx2, __attribute__((target("avx2"))))
SILU_MUL_ROWS(silu_mul_rows_plain, )

}  // namespace

// x (..., n) float32, weight (n,) float32 -> RMSNorm(x) * weight.
at::Tensor block_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const std::string& isa_name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
              weight.device().is_cpu(), "block_rms_norm: float32 tensors on a CPU");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "block_rms_norm: weight must have ", n, " elements");
  const Isa isa = speculative::isa_named(isa_name, "block_rms_norm");
  const at::Tensor flat = x.contiguous(), w = weight.contiguous();
  at::Tensor y = at::empty_like(flat);
  const int64_t rows = n == 0 ? 0 : flat.numel() / n;
  const float* in = flat.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    if (speculative::wide(isa)) norm_rows_avx512(in, wp, e, n, out, begin, end);
    else if (isa != Isa::plain) norm_rows_avx2(in, wp, e, n, out, begin, end);
    else norm_rows_plain(in, wp, e, n, out, begin, end);
  });
  return y;
}

// x (..., 2n) float32, a fused gate and up projection's output -> silu(gate) * up (..., n).
at::Tensor block_silu_mul(const at::Tensor& x, const std::string& isa_name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "block_silu_mul: a float32 tensor on a CPU whose last dimension (gate, then up) is even");
  const Isa isa = speculative::isa_named(isa_name, "block_silu_mul");
  const at::Tensor flat = x.contiguous();
  const int64_t n = x.size(-1) / 2, rows = n == 0 ? 0 : flat.numel() / (2 * n);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  const float* in = flat.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    if (speculative::wide(isa)) silu_mul_rows_avx512(in, n, out, begin, end);
    else if (isa != Isa::plain) silu_mul_rows_avx2(in, n, out, begin, end);
    else silu_mul_rows_plain(in, n, out, begin, end);
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(speculative_kernels, m) {
  m.def("block_rms_norm(Tensor x, Tensor weight, float eps, str isa) -> Tensor", &block_rms_norm);
  m.def("block_silu_mul(Tensor x, str isa) -> Tensor", &block_silu_mul);
}
