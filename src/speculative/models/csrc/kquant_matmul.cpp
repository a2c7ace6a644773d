// Width-invariant products with weights kept in llama.cpp's k-quant blocks (Q4_K, Q6_K: the
// bulk of a Q4_K_M GGUF file), y = x W^T (+ b), read as the file stores them: about half the
// bytes of int8 weights, and exactly the weights the file holds.
//
// A k-quant row is cut into super-blocks of 256 columns, each with a float scale d and offset
// dmin and sub-blocks (Q4_K: 8 of 32 columns, Q6_K: 16 of 16) with small integer scales sc and
// mins m: w = d * sc * q - dmin * m, q unsigned (Q4_K: 4 bits; Q6_K: 6 bits, and its offset of
// 32 is m = sc with dmin = 32 d). Each row of x is quantized to int8 per super-block (a float
// scale xs each, absolute maximum at 127: llama.cpp's Q8_K), so a super-block's share of a dot
// product is xs * (d * sum_j sc_j dot_j - dmin * sum_j m_j xsum_j), with exact integer sums
// (dot_j of q and x over sub-block j; xsum_j of x alone). Every output element is computed by
// one thread in one fixed order of float operations whatever the number of rows in the call,
// so a row gets the same bits alone or among others, on every instruction set below.
//
// Layout (kquant_pack): by groups of 16 output rows, super-block after super-block, each
// [quants][sub-block scales][mins (Q4_K)][d x 16][dmin x 16]. Quants come in 64-byte chunks
// that hold, for each of the 16 rows, 4 bytes of 8 columns (low nibbles the first 4, high
// nibbles the next 4; Q6_K's high 2 bits follow, `Layout`). One chunk feeds 2 x 16 sums
// (VNNI's dpbusd multiplies unsigned weights by signed activations, 4 per lane).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "avx2.h"
#include "group_loop.h"
#include "isa.h"
#include "quantize.h"

namespace {

using speculative::Isa;

constexpr int kGroup = 16;   // output rows per packed group
constexpr int kBlock = 256;  // columns per super-block
constexpr int kTokens = 8;   // input rows per pass over a group's weights
// Prefetches: into L1 4 KB ahead, and in the AVX-512 tile into L2 16 KB ahead (Zen 4, Qwen 1.5B's
// Q6_K down projections, 1 row: 8.2 ms against 11.5 with the first alone; 1 KB ahead alone:
// slower still). The AVX2 tile prefetches into L1 only: on a Zen 3 the second made it slower.
constexpr int64_t kPrefetch = 4096;
constexpr int64_t kQ4K = 12, kQ6K = 14;  // GGML's type numbers

// BITS: 4 (Q4_K) or 6 (Q6_K: the low 4 bits as Q4_K's nibbles, then the high 2 bits of each
// sub-block of 16 columns in one 64-byte chunk: each row's byte i holds, from bit 0, those of
// columns i, 4 + i, 8 + i and 12 + i of the sub-block).
template <int BITS>
struct Layout {
  static constexpr int kSub = BITS == 4 ? 32 : 16;  // columns per sub-block
  static constexpr int kSubs = kBlock / kSub;
  static constexpr int kChunkColumns = 8;  // columns per 64-byte chunk of nibbles
  static constexpr int kChunks = kBlock / kChunkColumns;
  static constexpr int kChunksPerSub = kSub / kChunkColumns;
  static constexpr bool kMins = BITS == 4;  // Q6_K's mins are its scales
  static constexpr int kNibbleBytes = kChunks * 64;
  static constexpr int kQuantBytes = kNibbleBytes + (BITS == 6 ? kSubs * 64 : 0);
  static constexpr int kScaleBytes = kSubs * kGroup * (kMins ? 2 : 1);
  static constexpr int kBytes = kQuantBytes + kScaleBytes + 2 * kGroup * 4;
};

int64_t block_bytes(int64_t bits) { return bits == 4 ? Layout<4>::kBytes : Layout<6>::kBytes; }

// Each row of x (M, K) to int8 per super-block (scale absmax / 127), with the integer sums of
// each sub-block of `sub` columns, by pairs in 16-bit halves: q (M, K), xs (M, K / 256), xsum (M, K / sub / 2).
void quantize_rows(const float* x, int64_t M, int64_t K, int sub, int8_t* q, float* xs, int32_t* xsum, Isa isa) {
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, M, speculative::quantize_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* in = x + m * K + b * kBlock;
        int8_t* out = q + m * K + b * kBlock;
        const float peak = speculative::abs_max(in, kBlock, isa);
        float& scale = xs[m * blocks + b];
        if (!(peak > 0.f) || !std::isfinite(peak)) {  // zeros give 0; inf or nan give nan
          std::fill(out, out + kBlock, int8_t(0));
          scale = peak == 0.f ? 0.f : std::numeric_limits<float>::quiet_NaN();
        } else {
          speculative::to_int8(in, kBlock, 127.f / peak, out, isa);
          scale = peak / 127.f;
        }
        for (int j = 0; j < kBlock / sub; j += 2) {  // two sub-blocks' sums as 16-bit halves (|sum| < 2^13)
          int32_t sums[2] = {0, 0};
          for (int e = 0; e < 2; ++e)  // one reduction each, which the compiler vectorizes
            for (int k = 0; k < sub; ++k) sums[e] += out[(j + e) * sub + k];
          const uint32_t pair = uint32_t(uint16_t(sums[0])) | (uint32_t(uint16_t(sums[1])) << 16);
          xsum[(m * blocks + b) * (kBlock / sub / 2) + j / 2] = int32_t(pair);
        }
      }
  });
}

// Pointers into one packed super-block of a group.
template <int BITS>
struct Block {
  using L = Layout<BITS>;
  const uint8_t* quants;
  const int8_t* scales;  // by pairs of sub-blocks: [pair][row][2] (`paired`)
  const int8_t* mins;
  const float* d;
  const float* dmin;
  explicit Block(const uint8_t* at)
      : quants(at),
        scales(reinterpret_cast<const int8_t*>(at + L::kQuantBytes)),
        mins(L::kMins ? scales + L::kSubs * kGroup : scales),
        d(reinterpret_cast<const float*>(at + L::kQuantBytes + L::kScaleBytes)),
        dmin(d + kGroup) {}
};

__attribute__((target("avx2")))
inline __m256i load256(const void* at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)); }

int32_t four_bytes(const int8_t* at) {
  int32_t v;
  std::memcpy(&v, at, 4);
  return v;
}

// out[t][r] = sum over super-blocks b of xs[t][b] * (d[r] * isum - dmin[r] * msum), T input
// rows against one group of 16 weight rows.
template <int BITS, int T>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void tile_avx512(const int8_t* q, int64_t K, const float* xs, const int32_t* xsum, const uint8_t* w, float* out) {
  using L = Layout<BITS>;
  // Independent sums per row where there are few rows, so that the multiply-adds do not wait
  // for each other (integer sums: the order does not change the result).
  constexpr int kChains = T == 1 ? 4 : T == 2 ? 2 : 1;
  const int64_t blocks = K / kBlock;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const Block<BITS> block(w + b * L::kBytes);
    __m512i isum[T];
    for (int t = 0; t < T; ++t) isum[t] = _mm512_setzero_si512();
    for (int j = 0; j < L::kSubs; j += 2) {  // sub-blocks by pairs, whose scales share a load
      const __m512i scales = _mm512_cvtepi8_epi16(load256(block.scales + j * kGroup));
      const __m512i sc[2] = {_mm512_srai_epi32(_mm512_slli_epi32(scales, 16), 16), _mm512_srai_epi32(scales, 16)};
      for (int e = 0; e < 2; ++e) {
        __m512i dot[T][kChains];
        for (int t = 0; t < T; ++t)
          for (int h = 0; h < kChains; ++h) dot[t][h] = _mm512_setzero_si512();
        __m512i two_bits = _mm512_setzero_si512();
        if constexpr (BITS == 6) two_bits = _mm512_loadu_si512(block.quants + L::kNibbleBytes + (j + e) * 64);
        for (int i = 0; i < L::kChunksPerSub; ++i) {
          const int c = (j + e) * L::kChunksPerSub + i;
          const __m512i wv = _mm512_loadu_si512(block.quants + c * 64);
          _mm_prefetch(reinterpret_cast<const char*>(block.quants + c * 64 + kPrefetch), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(block.quants + c * 64 + 4 * kPrefetch), _MM_HINT_T1);
          const int8_t* column = q + b * kBlock + c * L::kChunkColumns;
          __m512i low = _mm512_and_si512(wv, nibble);
          __m512i high = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nibble);
          if constexpr (BITS == 6) {  // each byte's high 2 bits to its bits 4-5 (16-bit shifts: the mask drops spill)
            const __m512i top = _mm512_set1_epi8(0x30);
            low = _mm512_or_si512(low, _mm512_and_si512(
                i == 0 ? _mm512_slli_epi16(two_bits, 4) : two_bits, top));
            high = _mm512_or_si512(high, _mm512_and_si512(
                i == 0 ? _mm512_slli_epi16(two_bits, 2) : _mm512_srli_epi16(two_bits, 2), top));
          }
          for (int t = 0; t < T; ++t) {
            __m512i& a = dot[t][(2 * i) % kChains];
            a = _mm512_dpbusd_epi32(a, low, _mm512_set1_epi32(four_bytes(column + t * K)));
            __m512i& z = dot[t][(2 * i + 1) % kChains];
            z = _mm512_dpbusd_epi32(z, high, _mm512_set1_epi32(four_bytes(column + t * K + 4)));
          }
        }
        for (int t = 0; t < T; ++t) {
          __m512i sum = dot[t][0];
          for (int h = 1; h < kChains; ++h) sum = _mm512_add_epi32(sum, dot[t][h]);
          isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(sum, sc[e]));
        }
      }
    }
    const __m512 d = _mm512_loadu_ps(block.d), dmin = _mm512_loadu_ps(block.dmin);
    for (int t = 0; t < T; ++t) {
      const int32_t* pairs = xsum + (t * blocks + b) * (L::kSubs / 2);
      __m512i msum = _mm512_setzero_si512();
      for (int j = 0; j < L::kSubs; j += 2) {  // m of two sub-blocks times their sums of x, as 16-bit pairs
        const __m512i m = _mm512_cvtepi8_epi16(load256(block.mins + j * kGroup));
        msum = _mm512_dpwssd_epi32(msum, m, _mm512_set1_epi32(pairs[j / 2]));
      }
      const __m512 part = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(isum[t])),
                                        _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(msum)));
      acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_set1_ps(xs[t * blocks + b]), part));
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + t * kGroup, acc[t]);
}

// Sub-block j's scales of rows 8h..8h+7 as 32-bit lanes, or (`both_halves`) in both 16-bit
// halves of each lane (the scales are stored by pairs of sub-blocks).
template <bool kWide>
__attribute__((target("avx2")))
inline __m256i scale_of(const int8_t* scales, int j, int h) {
  const __m256i pair = _mm256_cvtepi8_epi16(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + (j & ~1) * kGroup + h * 16)));
  if constexpr (kWide)
    return j % 2 == 0 ? _mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16) : _mm256_srai_epi32(pair, 16);
  return speculative::both_halves(pair, j % 2 == 1);
}

// The same with AVX2 (VNNI: AVX-VNNI) for T input rows and one super-block, for H halves of the
// group from half h0 (rows 8h..8h+7: 8 lanes each), adding each row's share to out. Without
// VNNI, maddubs multiplies unsigned weights (at most 63) by signed activations (at most 127 in
// size) two and two, within 16 bits, a chunk's two such sums are added in 16 bits (|sum| <=
// 32004), and one madd multiplies them by the sub-block's scale into the row's sum. For 1 or 2
// rows, Q4_K's 4 chunks of a sub-block are summed in 16 bits first (at most 30480), one madd a
// sub-block: fewer multiplies; for more rows its extra live registers measured slower (dev/LOG.md,
// 2026-12-07). With VNNI, dpbusd sums a sub-block in 32 bits, then one mullo scales it. Both
// halves in one pass (H = 2, for 1 or 2 rows) load each row's activations once for 16 rows of
// weights: fewer instructions between the loads of a memory-bound stream (AVX2 Zen 3, width 1).
template <int BITS, int T, bool VNNI, int H>
__attribute__((target("avx2")))
void block_avx2(const int8_t* column, int64_t K, const Block<BITS>& block, const float* xs, int64_t xs_stride,
                const int32_t* pairs, int64_t pairs_stride, int h0, float* out) {
  using L = Layout<BITS>;
  constexpr bool kSum16 = BITS == 4 && !VNNI && T <= 2;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i isum[H][T];
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < T; ++t) isum[h][t] = _mm256_setzero_si256();
  for (int j = 0; j < L::kSubs; ++j) {
    __m256i sc[H], dot[H][T];  // the sub-block's sums: VNNI's in 32 bits, kSum16's in 16
    __m256i two_bits[H];
    for (int h = 0; h < H; ++h) {
      sc[h] = scale_of<VNNI>(block.scales, j, h0 + h);
      for (int t = 0; t < T; ++t) dot[h][t] = _mm256_setzero_si256();
      if constexpr (BITS == 6) two_bits[h] = load256(block.quants + L::kNibbleBytes + j * 64 + (h0 + h) * 32);
    }
    for (int i = 0; i < L::kChunksPerSub; ++i) {
      const int c = j * L::kChunksPerSub + i;
      const int8_t* at = column + c * L::kChunkColumns;
      __m256i x0[T], x1[T];
      for (int t = 0; t < T; ++t) x0[t] = speculative::broadcast4(at + t * K), x1[t] = speculative::broadcast4(at + t * K + 4);
      for (int h = 0; h < H; ++h) {
        const __m256i wv = load256(block.quants + c * 64 + (h0 + h) * 32);
        __m256i low = _mm256_and_si256(wv, nibble);
        __m256i high = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nibble);
        if constexpr (BITS == 6) {
          const __m256i top = _mm256_set1_epi8(0x30), two = two_bits[h];
          low = _mm256_or_si256(low, _mm256_and_si256(i == 0 ? _mm256_slli_epi16(two, 4) : two, top));
          high = _mm256_or_si256(high, _mm256_and_si256(i == 0 ? _mm256_slli_epi16(two, 2) : _mm256_srli_epi16(two, 2), top));
        }
        for (int t = 0; t < T; ++t) {
          if constexpr (VNNI) {
            dot[h][t] = speculative::dpbusd_vex(speculative::dpbusd_vex(dot[h][t], low, x0[t]), high, x1[t]);
          } else {
            const __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(low, x0[t]), _mm256_maddubs_epi16(high, x1[t]));
            if constexpr (kSum16) dot[h][t] = _mm256_add_epi16(dot[h][t], sum);
            else isum[h][t] = speculative::madd_add<false>(isum[h][t], sum, sc[h]);
          }
        }
      }
    }
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) {
        if constexpr (VNNI) isum[h][t] = _mm256_add_epi32(isum[h][t], _mm256_mullo_epi32(dot[h][t], sc[h]));
        else if constexpr (kSum16) isum[h][t] = speculative::madd_add<false>(isum[h][t], dot[h][t], sc[h]);
      }
  }
  for (int h = 0; h < H; ++h) {
    const int half = h0 + h;
    const __m256 d = _mm256_loadu_ps(block.d + half * 8), dmin = _mm256_loadu_ps(block.dmin + half * 8);
    for (int t = 0; t < T; ++t) {
      __m256i msum = _mm256_setzero_si256();
      for (int j = 0; j < L::kSubs; j += 2) {  // m of two sub-blocks times their sums of x, as 16-bit pairs
        const __m256i m = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.mins + j * kGroup + half * 16)));
        msum = speculative::madd_add<VNNI>(msum, m, _mm256_set1_epi32(pairs[t * pairs_stride + j / 2]));
      }
      const __m256 part = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(isum[h][t])),
                                        _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(msum)));
      float* sum = out + t * kGroup + half * 8;
      _mm256_storeu_ps(sum, _mm256_add_ps(_mm256_loadu_ps(sum), _mm256_mul_ps(_mm256_set1_ps(xs[t * xs_stride]), part)));
    }
  }
}

// T <= 8 input rows: super-block after super-block, both halves of the group in one pass (1 or 2
// rows) or one after the other (the second reads the super-block's 2.4 KB again from L1), every
// row in one pass over the weights. One prefetch into L1 4 KB ahead: a second into L2 16 KB ahead,
// which the AVX-512 tile gains from on a Zen 4, made a Zen 3's width 1 13-19% slower.
template <int BITS, int T, bool VNNI>
__attribute__((target("avx2")))
void tile_avx2(const int8_t* q, int64_t K, const float* xs, const int32_t* xsum, const uint8_t* w, float* out) {
  using L = Layout<BITS>;
  constexpr int kHalves = T <= 2 ? 2 : 1;
  const int64_t blocks = K / kBlock, subs = L::kSubs / 2;
  std::fill(out, out + T * kGroup, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    const Block<BITS> block(w + b * L::kBytes);
    for (int line = 0; line < L::kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block.quants + line + kPrefetch), _MM_HINT_T0);
    for (int h0 = 0; h0 < 2; h0 += kHalves)
      block_avx2<BITS, T, VNNI, kHalves>(q + b * kBlock, K, block, xs + b, blocks, xsum + b * subs, blocks * subs, h0, out);
  }
}

// Where sub-block j's scale (or min) of row r is: by pairs of sub-blocks, each row's two together.
inline int paired(int j, int r) { return (j / 2) * 2 * kGroup + r * 2 + j % 2; }

// Sub-block j's sum of x from the pair of 16-bit sums that holds it.
inline int32_t xsum_of(int32_t pair, int j) {
  return j % 2 == 0 ? int16_t(pair & 0xFFFF) : int16_t(uint32_t(pair) >> 16);
}

// Unsigned quant of column k of row r in a packed super-block.
template <int BITS>
int32_t quant_at(const uint8_t* quants, int r, int k) {
  using L = Layout<BITS>;
  const int c = k / L::kChunkColumns, i = k % L::kChunkColumns;
  const uint8_t byte = quants[c * 64 + r * 4 + i % 4];
  const int32_t low = i < 4 ? byte & 0x0F : byte >> 4;
  if constexpr (BITS == 4) return low;
  const uint8_t two = quants[L::kNibbleBytes + (k / 16) * 64 + r * 4 + i % 4];
  return low | (((two >> ((c % 2) * 4 + (i < 4 ? 0 : 2))) & 3) << 4);
}

template <int BITS, int T>
void tile_plain(const int8_t* q, int64_t K, const float* xs, const int32_t* xsum, const uint8_t* w, float* out) {
  using L = Layout<BITS>;
  const int64_t blocks = K / kBlock;
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < kGroup; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const Block<BITS> block(w + b * L::kBytes);
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < L::kSubs; ++j) {
          int32_t dot = 0;
          for (int k = j * L::kSub; k < (j + 1) * L::kSub; ++k)
            dot += quant_at<BITS>(block.quants, r, k) * int32_t(q[t * K + b * kBlock + k]);
          isum += dot * block.scales[paired(j, r)];
          msum += int32_t(block.mins[paired(j, r)]) * xsum_of(xsum[(t * blocks + b) * (L::kSubs / 2) + j / 2], j);
        }
        const float part = block.d[r] * static_cast<float>(isum) - block.dmin[r] * static_cast<float>(msum);
        acc = acc + xs[t * blocks + b] * part;
      }
      out[t * kGroup + r] = acc;
    }
}

using TileFn = void (*)(const int8_t*, int64_t, const float*, const int32_t*, const uint8_t*, float*);

#define TILES(NAME, BITS, ...) \
  {NAME<BITS, 1, ##__VA_ARGS__>, NAME<BITS, 2, ##__VA_ARGS__>, NAME<BITS, 3, ##__VA_ARGS__>, \
   NAME<BITS, 4, ##__VA_ARGS__>, NAME<BITS, 5, ##__VA_ARGS__>, NAME<BITS, 6, ##__VA_ARGS__>, \
   NAME<BITS, 7, ##__VA_ARGS__>, NAME<BITS, 8, ##__VA_ARGS__>}

TileFn tile_for(Isa isa, int bits, int tokens) {
  static const TileFn tiles[4][2][kTokens] = {
      {TILES(tile_plain, 4), TILES(tile_plain, 6)},
      {TILES(tile_avx2, 4, false), TILES(tile_avx2, 6, false)},
      {TILES(tile_avx2, 4, true), TILES(tile_avx2, 6, true)},
      {TILES(tile_avx512, 4), TILES(tile_avx512, 6)}};
  return tiles[static_cast<int>(isa)][bits == 4 ? 0 : 1][tokens - 1];
}

// Q4_K's 6-bit scales and mins of sub-block j, from the block's 12 bytes (llama.cpp's layout).
void q4k_scale_min(const uint8_t* s, int j, int8_t& sc, int8_t& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One GGUF super-block of one row -> its 256 unsigned quants, sub-block scales, mins, d, dmin.
void decode(const uint8_t* raw, int64_t type, uint8_t* quants, int8_t* scales, int8_t* mins, float& d, float& dmin) {
  auto half = [](const uint8_t* at) {
    c10::Half h;
    std::memcpy(&h, at, 2);
    return static_cast<float>(h);
  };
  if (type == kQ4K) {  // d, dmin (halves), 12 bytes of scales and mins, 128 bytes of nibbles
    d = half(raw);
    dmin = half(raw + 2);
    for (int j = 0; j < 8; ++j) q4k_scale_min(raw + 4, j, scales[j], mins[j]);
    const uint8_t* qs = raw + 16;
    for (int part = 0; part < 4; ++part)  // 64 columns: low nibbles the first 32, high the next
      for (int l = 0; l < 32; ++l) {
        quants[part * 64 + l] = qs[part * 32 + l] & 0x0F;
        quants[part * 64 + 32 + l] = qs[part * 32 + l] >> 4;
      }
  } else {  // Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (half)
    const uint8_t* ql = raw;
    const uint8_t* qh = raw + 128;
    std::memcpy(scales, raw + 192, 16);
    std::memcpy(mins, raw + 192, 16);
    d = half(raw + 208);
    dmin = 32.f * d;  // w = d sc (q - 32) = d sc q - 32 d sc
    for (int n = 0; n < 2; ++n, ql += 64, qh += 32)
      for (int l = 0; l < 32; ++l) {
        uint8_t* out = quants + n * 128;
        out[l] = (ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4);
        out[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
        out[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        out[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
  }
}

template <int BITS>
void pack_group(const uint8_t* raw, int64_t rows, int64_t row_bytes, int64_t blocks, int64_t type, uint8_t* out) {
  using L = Layout<BITS>;
  const int64_t raw_block = type == kQ4K ? 144 : 210;
  uint8_t quants[kBlock];
  int8_t scales[16], mins[16];
  for (int64_t b = 0; b < blocks; ++b, out += L::kBytes) {
    std::memset(out, 0, L::kBytes);  // rows past the matrix: zeros
    int8_t* sc = reinterpret_cast<int8_t*>(out + L::kQuantBytes);
    int8_t* mn = sc + L::kSubs * kGroup;
    float* d = reinterpret_cast<float*>(out + L::kQuantBytes + L::kScaleBytes);
    for (int r = 0; r < rows; ++r) {
      decode(raw + r * row_bytes + b * raw_block, type, quants, scales, mins, d[r], d[kGroup + r]);
      for (int j = 0; j < L::kSubs; ++j) {
        sc[paired(j, r)] = scales[j];
        if (L::kMins) mn[paired(j, r)] = mins[j];
      }
      for (int c = 0; c < L::kChunks; ++c)
        for (int i = 0; i < 4; ++i) {
          const int k = c * L::kChunkColumns + i;
          out[c * 64 + r * 4 + i] = (quants[k] & 0x0F) | ((quants[k + 4] & 0x0F) << 4);
        }
      if (BITS == 6)  // sub-block j's high bits: columns i, 4 + i, 8 + i, 12 + i in byte i
        for (int j = 0; j < L::kSubs; ++j)
          for (int i = 0; i < 4; ++i) {
            const uint8_t* at = quants + j * 16 + i;
            out[L::kNibbleBytes + j * 64 + r * 4 + i] =
                (at[0] >> 4) | ((at[4] >> 4) << 2) | ((at[8] >> 4) << 4) | ((at[12] >> 4) << 6);
          }
    }
  }
}

}  // namespace

// raw (N, row bytes) uint8: a GGUF tensor's rows of Q4_K (type 12) or Q6_K (14) blocks ->
// (N_pad / 16, K / 256, block bytes) uint8 in this kernel's layout (zero rows to N_pad).
at::Tensor kquant_pack(const at::Tensor& raw, int64_t type, int64_t K) {
  TORCH_CHECK(type == kQ4K || type == kQ6K, "kquant_pack: GGML type ", type, " is not Q4_K (12) or Q6_K (14)");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(),
              "kquant_pack: raw blocks must be a contiguous (N, row bytes) uint8 tensor");
  TORCH_CHECK(K > 0 && K % kBlock == 0, "kquant_pack: ", K, " columns is not a multiple of ", kBlock);
  const int64_t blocks = K / kBlock, N = raw.size(0), row_bytes = raw.size(1);
  TORCH_CHECK(row_bytes == blocks * (type == kQ4K ? 144 : 210), "kquant_pack: ", row_bytes,
              " bytes per row do not hold ", K, " columns of this type");
  const int bits = type == kQ4K ? 4 : 6;
  const int64_t groups = (N + kGroup - 1) / kGroup, bytes = block_bytes(bits);
  at::Tensor packed = at::empty({groups, blocks, bytes}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t rows = std::min<int64_t>(kGroup, N - g * kGroup);
      const uint8_t* in = src + g * kGroup * row_bytes;
      uint8_t* out = dst + g * blocks * bytes;
      if (bits == 4) pack_group<4>(in, rows, row_bytes, blocks, type, out);
      else pack_group<6>(in, rows, row_bytes, blocks, type, out);
    }
  });
  return packed;
}

// x (..., K) float32; packed from kquant_pack; bits 4 (Q4_K) or 6 (Q6_K); bias (N,) or none.
at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t bits,
                         const c10::optional<at::Tensor>& bias, int64_t N, const std::string& isa_name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
              packed.is_contiguous(), "kquant_linear: float32 x and packed uint8 weights from kquant_pack");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "kquant_linear runs on CPUs");
  TORCH_CHECK(bits == 4 || bits == 6, "kquant_linear: bits must be 4 (Q4_K) or 6 (Q6_K), not ", bits);
  const int64_t K = x.size(-1), blocks = packed.size(1), Np = packed.size(0) * kGroup;
  TORCH_CHECK(packed.size(2) == block_bytes(bits) && K == blocks * kBlock && N <= Np && Np - N < kGroup,
              "kquant_linear: x has ", K, " columns and N = ", N, "; the packed weights do not match");
  const Isa isa = speculative::isa_named(isa_name, "kquant_linear");
  const int sub = bits == 4 ? Layout<4>::kSub : Layout<6>::kSub;
  const auto [flat, y] = speculative::rows_and_output(x, N);
  const int64_t M = flat.size(0);
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> q(M * K);
  std::vector<float> xs(M * blocks);
  std::vector<int32_t> xsum(M * K / sub / 2);
  quantize_rows(flat.data_ptr<float>(), M, K, sub, q.data(), xs.data(), xsum.data(), isa);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* b = bias && bias->defined() ? bias->data_ptr<float>() : nullptr;
  TORCH_CHECK(!b || bias->numel() == N, "kquant_linear: bias must have N = ", N, " elements");
  float* out = y.data_ptr<float>();
  const int64_t group_bytes = blocks * block_bytes(bits), subs = kBlock / sub;
  speculative::over_groups<kTokens>(M, N, kTokens, b, out, [&](int64_t m0, int tokens, int64_t g, float* sums) {
    tile_for(isa, bits, tokens)(q.data() + m0 * K, K, xs.data() + m0 * blocks, xsum.data() + m0 * blocks * subs / 2,
                                w + g * group_bytes, sums);
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(speculative_kernels, m) {
  m.def("kquant_pack(Tensor raw, int type, int k) -> Tensor", &kquant_pack);
  m.def("kquant_linear(Tensor x, Tensor packed, int bits, Tensor? bias, int n, str isa) -> Tensor", &kquant_linear);
}
