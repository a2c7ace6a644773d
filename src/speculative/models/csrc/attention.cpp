// One decoder block's attention over its position-indexed cache, in one call: rotary
// positions, the cache write, scores, softmax and the mix of values (the int8 and k-quant models
// on CPUs: `decoder_only.py`, `use_compiled_blocks`).
//
// Width invariance comes by construction: every output element is computed by one thread in one
// fixed order of float operations that depends only on its own row and the slots its mask lets
// it see, never on the other rows of the call, so a token gets the same bits decoded alone or
// verified among others; AVX512, AVX2 and plain C++ give the same bits (block_math.h).
// Attention reads only the slots from the first block of 16 that a query of an item sees to the
// last slot one sees (half of a causal prompt's scores; the rest would add nothing). With AVX512
// or AVX2, heads of 64, 128 or 256 run those operations for up to 8 queries of one kv head at
// once, each block of keys and values read once for all of them (`attend_queries_*`: Qwen 1.5B's
// attention at width 5 over 400 slots takes 0.6-0.7 of the time it took per query with AVX512;
// reading an 848-token prompt, AVX2, dev/LOG.md 2026-12-07).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "block_math.h"
#include "isa.h"

namespace {

using speculative::Isa;
using speculative::exp_poly;
using speculative::kLanes;
using speculative::lane_dot;

// Rotary positions as attention.rotate: y = x cos + roll(x, D/2) sin (sin's first half negated).
inline void rotate_row(const float* x, const float* cos, const float* sin, int64_t D, float* y) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) y[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
}

// Slots [from, to) hold every slot a query sees, from a multiple of 16: the slots outside add
// nothing to its sums, so leaving them out (half of a causal prompt's scores) changes no bit,
// whatever else a call holds.
inline void seen_range(const bool* seen, int64_t span, int64_t& from, int64_t& to) {
  int64_t first = 0, end = span;
  while (first < span && !seen[first]) ++first;
  while (end > first && !seen[end - 1]) --end;
  from = first / kLanes * kLanes;
  to = std::max(end, from);
}

struct Shape {
  int64_t T, H, G, D, S, span, qkv_row;  // queries per row, heads, kv heads, head size, slots, mask width
};

// Attention of query head h of token t of row b, over keys (S, D) and values (S, D) of its kv
// head, where seen (span) is true: scores in slot order, softmax, values mixed in slot order.
inline void attend_one(const float* q, const float* keys, const float* values, const bool* seen,
                       const Shape& s, float scale, float* scores, float* out) {
  float scaled[1024];
  for (int64_t i = 0; i < s.D; ++i) scaled[i] = q[i] * scale;
  int64_t from, to;
  seen_range(seen, s.span, from, to);
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t slot = from; slot < to; ++slot)
    if (seen[slot]) {
      scores[slot] = lane_dot(scaled, keys + slot * s.D, s.D);
      peak = std::max(peak, scores[slot]);
    }
  for (int64_t i = 0; i < s.D; ++i) out[i] = 0.f;
  if (peak == -std::numeric_limits<float>::infinity()) return;  // sees nothing (a padding token)
  float total = 0.f;
  for (int64_t slot = from; slot < to; ++slot)
    if (seen[slot]) {
      const float p = exp_poly(scores[slot] - peak);
      total += p;
      const float* v = values + slot * s.D;
      for (int64_t i = 0; i < s.D; ++i) out[i] += p * v[i];
    }
  const float inverse = 1.f / total;
  for (int64_t i = 0; i < s.D; ++i) out[i] *= inverse;
}

// The largest score among the slots [from, to) that a query sees, as attend_one's loop finds it
// (a NaN score is passed over; -inf when it sees none): 16 slots at a time, the same value
// whatever the order, as max is exact.
__attribute__((target("avx512f"))) inline float seen_peak(const float* row, const bool* seen, int64_t from,
                                                          int64_t to) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t slot = from;
  for (; slot + 16 <= to; slot += 16) {
    const __m512i flags = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(seen + slot)));
    const __m512 x = _mm512_loadu_ps(row + slot);
    const __mmask16 above = _mm512_mask_cmp_ps_mask(_mm512_test_epi32_mask(flags, flags), best, x, _CMP_LT_OQ);
    best = _mm512_mask_mov_ps(best, above, x);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, best);
  float peak = -std::numeric_limits<float>::infinity();
  for (float lane : lanes) peak = std::max(peak, lane);
  for (; slot < to; ++slot)
    if (seen[slot]) peak = std::max(peak, row[slot]);
  return peak;
}

// Up to kQueries queries attending to the same kv head: attend_one's operations for each, so
// its bits, in an order that reads keys and values once per block of 16 slots for all of them
// (from the L1 cache) instead of once per query (from L2), for heads of D = 16 * CHUNKS with
// AVX512. A block's 16 scores of a query come from its 16 slots' lanes of products summed by
// lane_dot's tree, whose levels run for the 16 slots at once by shuffles.
constexpr int kQueries = 8;

template <int CHUNKS>
__attribute__((target("avx512f"))) void attend_queries_avx512(const float* const* q, const bool* const* seen,
                                                            float* const* out, int R, const float* keys,
                                                            const float* values, int64_t span, float scale,
                                                            float* scores) {
  constexpr int D = 16 * CHUNKS;
  alignas(64) float scaled[kQueries][D];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CHUNKS; ++c)
      _mm512_store_ps(scaled[r] + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(q[r] + 16 * c), _mm512_set1_ps(scale)));
  // 1. scores, every slot that some query sees and those between (the others are never read).
  int64_t from = span, to = 0;
  for (int r = 0; r < R; ++r) {
    int64_t first, end;
    seen_range(seen[r], span, first, end);
    from = std::min(from, first);
    to = std::max(to, end);  // >= from: each query's end is at least its first
  }
  const int64_t whole = from + (to - from) / 16 * 16;
  for (int64_t first = from; first < whole; first += 16)
    for (int r = 0; r < R; ++r) {
      __m512 lanes[16];
      for (int k = 0; k < 16; ++k) {  // slot first + k into lanes[4 (k % 4) + k / 4]: the tree leaves them in order
        const float* key = keys + (first + k) * D;
        __m512 sum = _mm512_add_ps(_mm512_setzero_ps(), _mm512_mul_ps(_mm512_load_ps(scaled[r]), _mm512_loadu_ps(key)));
        for (int c = 1; c < CHUNKS; ++c)
          sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_load_ps(scaled[r] + 16 * c), _mm512_loadu_ps(key + 16 * c)));
        lanes[4 * (k % 4) + k / 4] = sum;
      }
      __m512 half[8], quarter[4], eighth[2];
      for (int m = 0; m < 8; ++m)  // lane j += lane j + 8
        half[m] = _mm512_add_ps(_mm512_shuffle_f32x4(lanes[2 * m], lanes[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_f32x4(lanes[2 * m], lanes[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
      for (int m = 0; m < 4; ++m)  // lane j += lane j + 4
        quarter[m] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * m], half[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(half[2 * m], half[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
      for (int m = 0; m < 2; ++m)  // lane j += lane j + 2
        eighth[m] = _mm512_add_ps(_mm512_shuffle_ps(quarter[2 * m], quarter[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(quarter[2 * m], quarter[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
      _mm512_storeu_ps(scores + r * span + first,  // lane 0 += lane 1
                       _mm512_add_ps(_mm512_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(3, 1, 3, 1))));
    }
  for (int r = 0; r < R; ++r)
    for (int64_t slot = whole; slot < to; ++slot) scores[r * span + slot] = lane_dot(scaled[r], keys + slot * D, D);
  // 2. softmax weights (scores become exp(score - peak)), each query's total in slot order.
  float inverse[kQueries], total[kQueries] = {};
  bool sees[kQueries];
  for (int r = 0; r < R; ++r) {
    float* row = scores + r * span;
    const float peak = seen_peak(row, seen[r], from, to);
    sees[r] = peak != -std::numeric_limits<float>::infinity();  // else a padding token: zeros
    if (sees[r])
      for (int64_t slot = from; slot < to; ++slot) row[slot] = exp_poly(row[slot] - peak);  // vectorized
  }
  for (int64_t slot = from; slot < to; ++slot)  // the queries' sums side by side: none waits for another
    for (int r = 0; r < R; ++r)
      if (seen[r][slot]) total[r] += scores[r * span + slot];
  for (int r = 0; r < R; ++r) inverse[r] = sees[r] ? 1.f / total[r] : 0.f;
  // 3. values mixed in slot order, 16 slots at a time for every query.
  alignas(64) float mixed[kQueries][D] = {};
  for (int64_t first = from; first < to; first += 16) {
    const int64_t last = std::min<int64_t>(to, first + 16);
    for (int r = 0; r < R; ++r) {
      if (inverse[r] == 0.f) continue;
      __m512 acc[CHUNKS];
      for (int c = 0; c < CHUNKS; ++c) acc[c] = _mm512_load_ps(mixed[r] + 16 * c);
      for (int64_t slot = first; slot < last; ++slot)
        if (seen[r][slot]) {
          const __m512 weight = _mm512_set1_ps(scores[r * span + slot]);
          const float* v = values + slot * D;
          for (int c = 0; c < CHUNKS; ++c)
            acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(weight, _mm512_loadu_ps(v + 16 * c)));
        }
      for (int c = 0; c < CHUNKS; ++c) _mm512_store_ps(mixed[r] + 16 * c, acc[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CHUNKS; ++c)
      _mm512_storeu_ps(out[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(mixed[r] + 16 * c), _mm512_set1_ps(inverse[r])));
}

// The same with AVX2: a 16-lane sum of lane_dot is two registers (lanes 0-7 and 8-15), so its
// tree's first level adds the two; the next three run for 8 slots at once by shuffles (slot k's
// partial sums into the half of register k % 4 that k / 4 says, which leaves the scores in slot
// order). Values are mixed 64 elements (8 registers) at a time.
template <int CHUNKS>
__attribute__((target("avx2"))) void attend_queries_avx2(const float* const* q, const bool* const* seen,
                                                         float* const* out, int R, const float* keys,
                                                         const float* values, int64_t span, float scale,
                                                         float* scores) {
  constexpr int D = 16 * CHUNKS, kParts = D / 64 > 0 ? D / 64 : 1, kPart = D / kParts;
  alignas(32) float scaled[kQueries][D];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < D; i += 8)
      _mm256_store_ps(scaled[r] + i, _mm256_mul_ps(_mm256_loadu_ps(q[r] + i), _mm256_set1_ps(scale)));
  // 1. scores, every slot that some query sees and those between (the others are never read).
  int64_t from = span, to = 0;
  for (int r = 0; r < R; ++r) {
    int64_t first, end;
    seen_range(seen[r], span, first, end);
    from = std::min(from, first);
    to = std::max(to, end);
  }
  const int64_t whole = from + (to - from) / 8 * 8;
  for (int64_t first = from; first < whole; first += 8)
    for (int r = 0; r < R; ++r) {
      __m256 lanes[8];
      for (int k = 0; k < 8; ++k) {
        const float* key = keys + (first + k) * D;
        __m256 low = _mm256_add_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_load_ps(scaled[r]), _mm256_loadu_ps(key)));
        __m256 high = _mm256_add_ps(_mm256_setzero_ps(),
                                    _mm256_mul_ps(_mm256_load_ps(scaled[r] + 8), _mm256_loadu_ps(key + 8)));
        for (int c = 1; c < CHUNKS; ++c) {
          low = _mm256_add_ps(low, _mm256_mul_ps(_mm256_load_ps(scaled[r] + 16 * c), _mm256_loadu_ps(key + 16 * c)));
          high = _mm256_add_ps(high, _mm256_mul_ps(_mm256_load_ps(scaled[r] + 16 * c + 8),
                                                   _mm256_loadu_ps(key + 16 * c + 8)));
        }
        lanes[k] = _mm256_add_ps(low, high);  // lane j += lane j + 8
      }
      __m256 half[4], quarter[2];
      for (int m = 0; m < 4; ++m)  // lane j += lane j + 4: slot m in the low 128 bits, slot m + 4 in the high
        half[m] = _mm256_add_ps(_mm256_permute2f128_ps(lanes[m], lanes[m + 4], 0x20),
                                _mm256_permute2f128_ps(lanes[m], lanes[m + 4], 0x31));
      for (int m = 0; m < 2; ++m)  // lane j += lane j + 2
        quarter[m] = _mm256_add_ps(_mm256_shuffle_ps(half[2 * m], half[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(half[2 * m], half[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
      _mm256_storeu_ps(scores + r * span + first,  // lane 0 += lane 1
                       _mm256_add_ps(_mm256_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm256_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(3, 1, 3, 1))));
    }
  for (int r = 0; r < R; ++r)
    for (int64_t slot = whole; slot < to; ++slot) scores[r * span + slot] = lane_dot(scaled[r], keys + slot * D, D);
  // 2. softmax weights (scores become exp(score - peak)), each query's total in slot order.
  float inverse[kQueries], total[kQueries] = {};
  for (int r = 0; r < R; ++r) {
    float* row = scores + r * span;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t slot = from; slot < to; ++slot)
      if (seen[r][slot]) peak = std::max(peak, row[slot]);  // a NaN score is passed over, as in attend_one
    inverse[r] = peak == -std::numeric_limits<float>::infinity() ? 0.f : 1.f;  // 0: a padding token, zeros
    if (inverse[r] != 0.f)
      for (int64_t slot = from; slot < to; ++slot) row[slot] = exp_poly(row[slot] - peak);  // vectorized
  }
  for (int64_t slot = from; slot < to; ++slot)
    for (int r = 0; r < R; ++r)
      if (seen[r][slot]) total[r] += scores[r * span + slot];
  for (int r = 0; r < R; ++r) inverse[r] = inverse[r] != 0.f ? 1.f / total[r] : 0.f;
  // 3. values mixed in slot order, 16 slots at a time for every query, a part of the head at a time.
  alignas(32) float mixed[kQueries][D] = {};
  for (int64_t first = from; first < to; first += 16) {
    const int64_t last = std::min<int64_t>(to, first + 16);
    for (int r = 0; r < R; ++r) {
      if (inverse[r] == 0.f) continue;
      for (int part = 0; part < kParts; ++part) {
        float* mix = mixed[r] + part * kPart;
        __m256 acc[kPart / 8];
        for (int c = 0; c < kPart / 8; ++c) acc[c] = _mm256_load_ps(mix + 8 * c);
        for (int64_t slot = first; slot < last; ++slot)
          if (seen[r][slot]) {
            const __m256 weight = _mm256_set1_ps(scores[r * span + slot]);
            const float* v = values + slot * D + part * kPart;
            for (int c = 0; c < kPart / 8; ++c)
              acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(weight, _mm256_loadu_ps(v + 8 * c)));
          }
        for (int c = 0; c < kPart / 8; ++c) _mm256_store_ps(mix + 8 * c, acc[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < D; i += 8)
      _mm256_storeu_ps(out[r] + i, _mm256_mul_ps(_mm256_load_ps(mixed[r] + i), _mm256_set1_ps(inverse[r])));
}

// The per-item work, compiled once per instruction set (flatten inlines the helpers into each).
#define ATTEND_ITEMS(NAME, TARGET)                                                                        \
  TARGET __attribute__((flatten)) void NAME(const float* rotated_q, const float* cache_k, const float* cache_v, \
                                            const bool* mask, const Shape& s, float scale, float* out,    \
                                            int64_t begin, int64_t end) {                                 \
    std::vector<float> scores(s.span);                                                                    \
    const int64_t group = s.H / s.G;                                                                      \
    for (int64_t item = begin; item < end; ++item) { /* item = (b, t, h) */                               \
      const int64_t h = item % s.H, t = item / s.H % s.T, b = item / (s.H * s.T), g = h / group;          \
      const float* kv_k = cache_k + (b * s.G + g) * s.S * s.D;                                            \
      const float* kv_v = cache_v + (b * s.G + g) * s.S * s.D;                                            \
      attend_one(rotated_q + ((b * s.T + t) * s.H + h) * s.D, kv_k, kv_v, mask + (b * s.T + t) * s.span,  \
                 s, scale, scores.data(), out + ((b * s.T + t) * s.H + h) * s.D);                         \
    }                                                                                                     \
  }

ATTEND_ITEMS(attend_items_avx512, __attribute__((target("avx512f"))))
ATTEND_ITEMS(attend_items_avx2, __attribute__((target("avx2"))))
ATTEND_ITEMS(attend_items_plain, )

// Work item i of attend_queries: row b, kv head g, and its queries (token t, head h of the
// group) from number i % chunks * kQueries, numbered t * group + h % group. WIDE: AVX512, else AVX2.
template <int CHUNKS, bool WIDE>
void attend_grouped(const float* rotated_q, const float* cache_k, const float* cache_v, const bool* mask,
                    const Shape& s, float scale, float* out, int64_t begin, int64_t end) {
  const int64_t group = s.H / s.G, queries = group * s.T, chunks = (queries + kQueries - 1) / kQueries;
  std::vector<float> scores(kQueries * s.span);
  const float* q[kQueries];
  const bool* seen[kQueries];
  float* o[kQueries];
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / (s.G * chunks), g = item / chunks % s.G, from = item % chunks * kQueries;
    const int R = static_cast<int>(std::min<int64_t>(kQueries, queries - from));
    for (int r = 0; r < R; ++r) {
      const int64_t t = (from + r) / group, h = g * group + (from + r) % group;
      const int64_t at = ((b * s.T + t) * s.H + h) * s.D;
      q[r] = rotated_q + at;
      o[r] = out + at;
      seen[r] = mask + (b * s.T + t) * s.span;
    }
    const float *keys = cache_k + (b * s.G + g) * s.S * s.D, *values = cache_v + (b * s.G + g) * s.S * s.D;
    if constexpr (WIDE) attend_queries_avx512<CHUNKS>(q, seen, o, R, keys, values, s.span, scale, scores.data());
    else attend_queries_avx2<CHUNKS>(q, seen, o, R, keys, values, s.span, scale, scores.data());
  }
}

template <bool WIDE>
void attend_grouped_any(const float* rq, const float* keys, const float* values, const bool* seen, const Shape& s,
                        float scale, float* out, int64_t begin, int64_t end) {
  if (s.D == 64) attend_grouped<4, WIDE>(rq, keys, values, seen, s, scale, out, begin, end);
  else if (s.D == 128) attend_grouped<8, WIDE>(rq, keys, values, seen, s, scale, out, begin, end);
  else attend_grouped<16, WIDE>(rq, keys, values, seen, s, scale, out, begin, end);
}

}  // namespace

// One block's attention over its cache, in one call.
//   qkv (B, T, (H + 2G) D): the fused projection's output (q heads, then k, then v);
//   cos, sin (B, 1, T, D): rotary tables (attention.rope_table: sin's first half negated);
//   cache_k, cache_v (B, G, S, D): the rows in use; token t of row b is written to slot
//   targets[b, t] (B, T) and then every token attends where mask (B, T, span) is true, span <= S.
// Returns (B, T, H D): each head's mix of values, heads side by side.
at::Tensor block_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& cache_k, const at::Tensor& cache_v, const at::Tensor& targets,
                           const at::Tensor& mask, int64_t heads, int64_t kv_heads, double scale,
                           const std::string& isa_name) {
  TORCH_CHECK(qkv.dim() == 3 && cache_k.dim() == 4 && mask.dim() == 3 && targets.dim() == 2,
              "block_attention: qkv (B, T, (H + 2G) D), caches (B, G, S, D), targets (B, T), mask (B, T, span)");
  const int64_t B = qkv.size(0), T = qkv.size(1), D = cache_k.size(3), S = cache_k.size(2), span = mask.size(2);
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cache_k.scalar_type() == at::kFloat &&
              cache_v.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && mask.scalar_type() == at::kBool &&
              targets.scalar_type() == at::kLong, "block_attention: float32 tensors, a bool mask, int64 targets");
  TORCH_CHECK(qkv.device().is_cpu() && cache_k.device().is_cpu(), "block_attention runs on CPUs");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && D % 2 == 0 && D <= 1024,
              "block_attention: heads must be a multiple of kv heads, head size even and at most 1024");
  TORCH_CHECK(qkv.size(2) == (heads + 2 * kv_heads) * D && cache_k.size(0) >= B && cache_k.size(1) == kv_heads &&
              cache_v.sizes() == cache_k.sizes() && cache_k.is_contiguous() && cache_v.is_contiguous() &&
              cos.numel() == B * T * D && sin.numel() == B * T * D && targets.size(0) == B &&
              targets.size(1) == T && mask.size(0) == B && mask.size(1) == T && span <= S,
              "block_attention: shapes do not match");
  const Isa isa = speculative::isa_named(isa_name, "block_attention");
  const Shape s{T, heads, kv_heads, D, S, span, (heads + 2 * kv_heads) * D};
  const at::Tensor in = qkv.contiguous(), c = cos.contiguous(), sn = sin.contiguous(), m = mask.contiguous(),
                   slot = targets.contiguous();
  const float *x = in.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = sn.data_ptr<float>();
  const int64_t* where = slot.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(where[i] >= 0 && where[i] < S, "block_attention: target slot ", where[i], " outside 0..", S - 1);
  float *keys = cache_k.data_ptr<float>(), *values = cache_v.data_ptr<float>();
  at::Tensor rotated_q = at::empty({B, T, heads, D}, in.options());
  float* rq = rotated_q.data_ptr<float>();
  // 1. rotate queries and keys; write keys and values (a row's tokens in order: padding
  // tokens may share the scratch slot).
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const float* row = x + (b * T + t) * s.qkv_row;
        const float *rc = cp + (b * T + t) * D, *rs = sp + (b * T + t) * D;
        for (int64_t h = 0; h < heads; ++h) rotate_row(row + h * D, rc, rs, D, rq + ((b * T + t) * heads + h) * D);
        const int64_t at_slot = where[b * T + t];
        for (int64_t g = 0; g < kv_heads; ++g) {
          float* k = keys + ((b * kv_heads + g) * S + at_slot) * D;
          float* v = values + ((b * kv_heads + g) * S + at_slot) * D;
          rotate_row(row + (heads + g) * D, rc, rs, D, k);
          std::copy(row + (heads + kv_heads + g) * D, row + (heads + kv_heads + g + 1) * D, v);
        }
      }
  });
  // 2. every query head of every token, each on its own.
  at::Tensor out = at::empty({B, T, heads * D}, in.options());
  float* o = out.data_ptr<float>();
  const bool* seen = m.data_ptr<bool>();
  const float sc = static_cast<float>(scale);
  if (isa != Isa::plain && (D == 64 || D == 128 || D == 256)) {
    const int64_t chunks = (heads / kv_heads * T + kQueries - 1) / kQueries;
    at::parallel_for(0, B * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
      if (speculative::wide(isa)) attend_grouped_any<true>(rq, keys, values, seen, s, sc, o, begin, end);
      else attend_grouped_any<false>(rq, keys, values, seen, s, sc, o, begin, end);
    });
    return out;
  }
  at::parallel_for(0, B * T * heads, 1, [&](int64_t begin, int64_t end) {
    if (speculative::wide(isa)) attend_items_avx512(rq, keys, values, seen, s, sc, o, begin, end);
    else if (isa != Isa::plain) attend_items_avx2(rq, keys, values, seen, s, sc, o, begin, end);
    else attend_items_plain(rq, keys, values, seen, s, sc, o, begin, end);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(speculative_kernels, m) {
  m.def("block_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) cache_k, Tensor(b!) cache_v, "
        "Tensor targets, Tensor mask, int heads, int kv_heads, float scale, str isa) -> Tensor",
        &block_attention);
}
