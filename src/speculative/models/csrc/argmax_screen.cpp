// The compiled parts of models/argmax_screen.py.
//
// screen_weights: the screen's int8 rows of a float32 output layer (scale absmax / 127 per row)
// with each row's |w - scale q|_2 and scale |q|_2 in float64 (the products and differences
// exact, the sums rounding at 1e-16).
//
// screen_candidates: for each row n of a screen (N, V) float32, the tokens v whose screen score
// a_v plus their own bound b_v reaches the floor, where b_v = p + rounding * (|a_v| + 2 p + 1),
// p = error[v] * norms[n][0] + norm[v] * norms[n][1] (float64). The floor is the exact score e
// of the screen's best token (the row's largest a, the first at ties; scored as exact_scores
// scores it, plus its bias) less rounding * (|e| + 1): no token whose exact score rounds to e
// or more lies under it. (The screen's own lower bound, best - b_best, sits about b_best lower:
// on Gemma 3's decoding it let through 25-75 times as many.) A row with a NaN anywhere gets
// none, as does one whose e is NaN (a NaN weight: the engine ends such rows). Tokens
// are first compared, in float32, with a threshold below every candidate's (from the widest p
// of any token), then checked in float64.
//
// exact_scores: out[p] = the float32 rounding of the float64 dot product of hidden[rows[p]] and
// weight[tokens[p]] (a float32 or bfloat16 weight; a bfloat16 row is made float32 exactly, then
// scored as a float32 one). Products of float32 values are exact in float64; the sum runs in one
// fixed order (8 lanes, then a fixed tree), so a pair gets the same bits whatever else the call
// scores, on every instruction set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>
#include <string>
#include <vector>

#include "isa.h"

namespace {

using speculative::Isa;

inline double lanes_sum(const double* acc) {
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// Lane j sums the products of columns j, 8 + j, 16 + j, ... then the remainder's, as the
// vector versions below do (a product, then a sum: no fused multiply-add).
double dot_plain(const float* w, const float* h, int64_t K) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    for (int j = 0; j < 8; ++j) acc[j] += static_cast<double>(w[k + j]) * h[k + j];
  for (int j = 0; k < K; ++k, ++j) acc[j] += static_cast<double>(w[k]) * h[k];
  return lanes_sum(acc);
}

__attribute__((target("avx512f"))) double dot_avx512(const float* w, const float* h, int64_t K) {
  __m512d acc = _mm512_setzero_pd();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    acc = _mm512_add_pd(acc, _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(w + k)),
                                           _mm512_cvtps_pd(_mm256_loadu_ps(h + k))));
  alignas(64) double lanes[8];
  _mm512_store_pd(lanes, acc);
  for (int j = 0; k < K; ++k, ++j) lanes[j] += static_cast<double>(w[k]) * h[k];
  return lanes_sum(lanes);
}

__attribute__((target("avx2"))) double dot_avx2(const float* w, const float* h, int64_t K) {
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    low = _mm256_add_pd(low, _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(w + k)), _mm256_cvtps_pd(_mm_loadu_ps(h + k))));
    high = _mm256_add_pd(high, _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(w + k + 4)),
                                             _mm256_cvtps_pd(_mm_loadu_ps(h + k + 4))));
  }
  alignas(32) double lanes[8];
  _mm256_store_pd(lanes, low);
  _mm256_store_pd(lanes + 4, high);
  for (int j = 0; k < K; ++k, ++j) lanes[j] += static_cast<double>(w[k]) * h[k];
  return lanes_sum(lanes);
}

double dot(const float* w, const float* h, int64_t K, Isa isa) {
  if (speculative::wide(isa)) return dot_avx512(w, h, K);
  if (isa != Isa::plain) return dot_avx2(w, h, K);
  return dot_plain(w, h, K);
}

// The float32 rounding of the float64 dot product of token t's weight row and h (`row`: room
// for a bfloat16 row made float32).
float exact_score(const float* w, const at::BFloat16* w16, int64_t t, const float* h, int64_t K, Isa isa,
                  std::vector<float>& row) {
  if (w16 != nullptr) {
    const at::BFloat16* source = w16 + t * K;
    for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(source[k]);
  }
  return static_cast<float>(dot(w16 != nullptr ? row.data() : w + t * K, h, K, isa));
}

// A contiguous (V, K) float32 or bfloat16 weight: (float32 data or null, bfloat16 data or null).
std::pair<const float*, const at::BFloat16*> weight_data(const at::Tensor& weight, const char* op) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && (weight.scalar_type() == at::kFloat || bf16), op,
              ": weight must be a contiguous (V, K) float32 or bfloat16 matrix");
  return {bf16 ? nullptr : weight.data_ptr<float>(), bf16 ? weight.data_ptr<at::BFloat16>() : nullptr};
}

void check_hidden(const at::Tensor& hidden, int64_t K, const char* op) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat &&
                  hidden.size(1) == K,
              op, ": hidden must be a contiguous (N, K) float32 matrix with the weight's K");
}

at::Tensor exact_scores(const at::Tensor& weight, const at::Tensor& hidden, const at::Tensor& rows,
                        const at::Tensor& tokens, const std::string& isa_name) {
  const Isa isa = speculative::isa_named(isa_name, "exact_scores");
  const auto [w, w16] = weight_data(weight, "exact_scores");
  check_hidden(hidden, weight.size(1), "exact_scores");
  TORCH_CHECK(rows.scalar_type() == at::kLong && tokens.scalar_type() == at::kLong && rows.dim() == 1 &&
                  tokens.sizes() == rows.sizes() && rows.is_contiguous() && tokens.is_contiguous(),
              "exact_scores: rows and tokens must be contiguous int64 vectors of one length");
  const int64_t P = rows.numel(), K = weight.size(1), V = weight.size(0), N = hidden.size(0);
  at::Tensor out = at::empty({P}, hidden.options());
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* t = tokens.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(r[p] >= 0 && r[p] < N && t[p] >= 0 && t[p] < V, "exact_scores: pair ", p, " is out of range");
  const float* h = hidden.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, P, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> row(w16 != nullptr ? K : 0);
    for (int64_t p = begin; p < end; ++p) o[p] = exact_score(w, w16, t[p], h + r[p] * K, K, isa, row);
  });
  return out;
}

// The row's largest score; NaN if any score is NaN.
float row_max(const float* x, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) {
    const float s = x[v];
    if (std::isnan(s)) return s;
    best = std::max(best, s);
  }
  return best;
}

__attribute__((target("avx512f"))) float row_max_avx512(const float* x, int64_t V) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t v = 0;
  for (; v + 16 <= V; v += 16) {
    const __m512 s = _mm512_loadu_ps(x + v);
    nan |= _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, s);
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  float out = _mm512_reduce_max_ps(best);
  for (; v < V; ++v) {
    if (std::isnan(x[v])) return x[v];
    out = std::max(out, x[v]);
  }
  return out;
}

// check(v) for every token whose score is at least `threshold`, in order.
template <typename Check>
__attribute__((target("avx512f"))) void above_avx512(const float* x, int64_t V, float threshold, Check&& check) {
  const __m512 limit = _mm512_set1_ps(threshold);
  int64_t v = 0;
  for (; v + 16 <= V; v += 16) {
    const __m512 s = _mm512_loadu_ps(x + v);
    for (__mmask16 m = _mm512_cmp_ps_mask(s, limit, _CMP_GE_OQ); m; m &= m - 1) check(v + __builtin_ctz(m));
  }
  for (; v < V; ++v)
    if (x[v] >= threshold) check(v);
}

std::tuple<at::Tensor, at::Tensor> screen_candidates(const at::Tensor& screen,
                                                     const at::Tensor& error, const at::Tensor& norm,
                                                     const at::Tensor& norms, double widest_error, double widest_norm,
                                                     double rounding, const at::Tensor& weight,
                                                     const at::Tensor& hidden, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(screen.dim() == 2 && screen.scalar_type() == at::kFloat && screen.is_contiguous(),
              "screen_candidates: the screen must be a contiguous (N, V) float32 matrix");
  const int64_t N = screen.size(0), V = screen.size(1), K = weight.size(1);
  TORCH_CHECK(error.scalar_type() == at::kDouble && norm.scalar_type() == at::kDouble && error.numel() == V &&
                  norm.numel() == V && error.is_contiguous() && norm.is_contiguous(),
              "screen_candidates: error and norm must be contiguous float64 vectors of V entries");
  TORCH_CHECK(norms.scalar_type() == at::kDouble && norms.dim() == 2 && norms.size(0) == N && norms.size(1) == 2 &&
                  norms.is_contiguous(),
              "screen_candidates: norms must be a contiguous (N, 2) float64 matrix");
  const auto [w, w16] = weight_data(weight, "screen_candidates");
  TORCH_CHECK(weight.size(0) == V, "screen_candidates: the weight must have the screen's V rows");
  check_hidden(hidden, K, "screen_candidates");
  TORCH_CHECK(hidden.size(0) == N, "screen_candidates: hidden must have the screen's N rows");
  const bool biased = bias.has_value() && bias->defined();
  TORCH_CHECK(!biased || (bias->scalar_type() == at::kFloat && bias->numel() == V && bias->is_contiguous()),
              "screen_candidates: bias must be a contiguous float32 vector of V entries");
  const float* b = biased ? bias->data_ptr<float>() : nullptr;
  const float* hid = hidden.data_ptr<float>();
  const Isa isa = speculative::best_isa();
  const float* a = screen.data_ptr<float>();
  const double* err = error.data_ptr<double>();
  const double* nrm = norm.data_ptr<double>();
  const double* hn = norms.data_ptr<double>();
  std::vector<std::vector<int64_t>> found(N);
  const bool wide = speculative::wide(speculative::best_isa());
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(w16 != nullptr ? K : 0);
    for (int64_t n = begin; n < end; ++n) {
      const float* x = a + n * V;
      const float best = wide ? row_max_avx512(x, V) : row_max(x, V);
      if (std::isnan(best) || best == -std::numeric_limits<float>::infinity()) continue;  // NaN, or nothing finite
      int64_t at = 0;
      while (x[at] != best) ++at;
      const double h = hn[2 * n], r = hn[2 * n + 1];
      auto bound = [&](double p, double value) { return p + rounding * (std::fabs(value) + 2 * p + 1); };
      float e = exact_score(w, w16, at, hid + n * K, K, isa, row);
      if (b != nullptr) e = static_cast<float>(static_cast<double>(e) + static_cast<double>(b[at]));
      if (std::isnan(e)) continue;
      const double floor = std::max(best - bound(err[at] * h + nrm[at] * r, best), e - rounding * (std::fabs(e) + 1));
      const double spread = widest_error * h + widest_norm * r;
      // Every candidate lies in [floor - spread - 1, best] (rounding is tiny), so |a_v| <= z.
      const double z = std::fabs(static_cast<double>(best)) + std::fabs(floor) + 2 * spread + 1;
      float threshold = static_cast<float>(floor - spread - rounding * (z + 2 * spread + 1));
      threshold = std::nextafter(threshold, -std::numeric_limits<float>::infinity());
      auto check = [&](int64_t v) {
        const float s = x[v];
        if (s + bound(err[v] * h + nrm[v] * r, s) >= floor) found[n].push_back(v);
      };
      if (wide)
        above_avx512(x, V, threshold, check);
      else
        for (int64_t v = 0; v < V; ++v)
          if (x[v] >= threshold) check(v);
    }
  });
  int64_t total = 0;
  for (const auto& f : found) total += static_cast<int64_t>(f.size());
  at::Tensor rows = at::empty({total}, screen.options().dtype(at::kLong));
  at::Tensor tokens = at::empty({total}, screen.options().dtype(at::kLong));
  int64_t* r = rows.data_ptr<int64_t>();
  int64_t* t = tokens.data_ptr<int64_t>();
  for (int64_t n = 0, p = 0; n < N; ++n)
    for (const int64_t v : found[n]) r[p] = n, t[p++] = v;
  return {rows, tokens};
}

// One row of screen_weights: q = w * (127 / absmax) rounded to nearest even within +-127, scale =
// absmax / 127 (at least 1e-12), |w - scale q|_2 and scale |q|_2. The vector version rounds
// and sums in another order: a process keeps one, and the bounds hold for either.
void screen_row(const float* row, int64_t K, int8_t* q, float* scale, double* error, double* norm) {
  float peak = 0.f;
  for (int64_t k = 0; k < K; ++k) peak = std::max(peak, std::fabs(row[k]));
  const float step = std::max(peak / 127.f, 1e-12f), inverse = 1.f / step;
  double e = 0, n = 0;
  for (int64_t k = 0; k < K; ++k) {
    const float r = std::min(127.f, std::max(-127.f, std::nearbyint(row[k] * inverse)));
    q[k] = static_cast<int8_t>(r);
    const double left = static_cast<double>(row[k]) - static_cast<double>(step) * r;
    e += left * left;
    n += static_cast<double>(r) * r;
  }
  *scale = step;
  *error = std::sqrt(e);
  *norm = static_cast<double>(step) * std::sqrt(n);
}

__attribute__((target("avx512f,avx512bw"))) void screen_row_avx512(const float* row, int64_t K, int8_t* q,
                                                                   float* scale, double* error, double* norm) {
  __m512 most = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) most = _mm512_max_ps(most, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
  float peak = _mm512_reduce_max_ps(most);
  for (; k < K; ++k) peak = std::max(peak, std::fabs(row[k]));
  const float step = std::max(peak / 127.f, 1e-12f), inverse = 1.f / step;
  const __m512 inv = _mm512_set1_ps(inverse), high = _mm512_set1_ps(127.f), low = _mm512_set1_ps(-127.f);
  const __m512d stepd = _mm512_set1_pd(step);
  __m512d e = _mm512_setzero_pd(), n = _mm512_setzero_pd();
  for (k = 0; k + 16 <= K; k += 16) {
    const __m512 x = _mm512_loadu_ps(row + k);
    const __m512 r = _mm512_min_ps(high, _mm512_max_ps(low, _mm512_roundscale_ps(_mm512_mul_ps(x, inv),
                                                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
    const __m512d x0 = _mm512_cvtps_pd(_mm512_castps512_ps256(x)), r0 = _mm512_cvtps_pd(_mm512_castps512_ps256(r));
    const __m512d x1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    const __m512d r1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
    const __m512d left0 = _mm512_sub_pd(x0, _mm512_mul_pd(stepd, r0)), left1 = _mm512_sub_pd(x1, _mm512_mul_pd(stepd, r1));
    e = _mm512_add_pd(e, _mm512_add_pd(_mm512_mul_pd(left0, left0), _mm512_mul_pd(left1, left1)));
    n = _mm512_add_pd(n, _mm512_add_pd(_mm512_mul_pd(r0, r0), _mm512_mul_pd(r1, r1)));
  }
  double es = _mm512_reduce_add_pd(e), nsum = _mm512_reduce_add_pd(n);
  for (; k < K; ++k) {
    const float r = std::min(127.f, std::max(-127.f, std::nearbyint(row[k] * inverse)));
    q[k] = static_cast<int8_t>(r);
    const double left = static_cast<double>(row[k]) - static_cast<double>(step) * r;
    es += left * left;
    nsum += static_cast<double>(r) * r;
  }
  *scale = step;
  *error = std::sqrt(es);
  *norm = static_cast<double>(step) * std::sqrt(nsum);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> screen_weights(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "screen_weights: weight must be a contiguous (V, K) float32 matrix");
  const int64_t V = weight.size(0), K = weight.size(1);
  at::Tensor q = at::empty({V, K}, weight.options().dtype(at::kChar));
  at::Tensor scale = at::empty({V}, weight.options());
  at::Tensor error = at::empty({V}, weight.options().dtype(at::kDouble));
  at::Tensor norm = at::empty({V}, weight.options().dtype(at::kDouble));
  const float* w = weight.data_ptr<float>();
  int8_t* qs = q.data_ptr<int8_t>();
  float* ss = scale.data_ptr<float>();
  double* es = error.data_ptr<double>();
  double* ns = norm.data_ptr<double>();
  const bool wide = speculative::wide(speculative::best_isa());
  at::parallel_for(0, V, 64, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v)
      (wide ? screen_row_avx512 : screen_row)(w + v * K, K, qs + v * K, ss + v, es + v, ns + v);
  });
  return {q, scale, error, norm};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speculative_kernels, m) {
  m.def("screen_weights(Tensor weight) -> (Tensor, Tensor, Tensor, Tensor)", &screen_weights);
  m.def("screen_candidates(Tensor screen, Tensor error, Tensor norm, Tensor norms, float widest_error, "
        "float widest_norm, float rounding, Tensor weight, Tensor hidden, Tensor? bias) -> (Tensor, Tensor)", &screen_candidates);
  m.def("exact_scores(Tensor weight, Tensor hidden, Tensor rows, Tensor tokens, str isa) -> Tensor", &exact_scores);
}
