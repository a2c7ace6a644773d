// Width-invariant products with weights kept in GGUF's 32-column blocks, y = x W^T (+ b), read
// as the file stores them: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (4.5 to 8.5 bits a weight, where int8
// reads 8 and a float scale per row). Q5_0 and Q8_0 are what a Q4_K_M file keeps where rows are
// not a multiple of 256 columns (Qwen2.5-Coder 0.5B, most of Gemma 3 270M); Q4_0 and Q4_1 are
// whole files of their own (SmolLM2's is Q4_1).
//
// A block of 32 columns holds a half-precision scale d and unsigned quants u (4, 5 or 8 bits):
// w = d * (u - o) for the "_0" types, o = 8 (Q4_0), 16 (Q5_0) or 128 (Q8_0: its signed quants
// stored as u = q + 128); w = d * u + m for the "_1" types, m a half-precision min. Each row of x
// is quantized to int8 per 32 columns (a float scale xs each, absolute maximum at 127: llama.cpp's
// Q8_0), so a block's share of a dot product is xs * d * (dot(u, x) - o * sum(x)), or xs * (d *
// dot(u, x) + m * sum(x)), the integers exact. Every output element is computed by one thread in
// one fixed order of float operations whatever the number of rows in the call, so a row gets the
// same bits alone or among others, on every instruction set below.
//
// Layout (q32_pack): by groups of 16 output rows, block after block, each [quants][d x 16][m x 16
// for "_1" types], halves. 4- and 5-bit quants: 4 chunks of 64 bytes holding, for each of the 16
// rows, 4 bytes of 8 columns (low nibbles the first 4, high nibbles the next 4, as
// kquant_matmul.cpp's), then for 5 bits 64 bytes of fifth bits (row r's byte i: from bit 0, those
// of columns i, 4 + i, 8 + i, 12 + i, ... of the 4 chunks, two per chunk). Q8_0's: 8 chunks of 64
// bytes, each 4 columns of the 16 rows.
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
#include <type_traits>
#include <utility>
#include <vector>

#include "avx2.h"
#include "group_loop.h"
#include "isa.h"
#include "quantize.h"

namespace {

using speculative::Isa;

constexpr int kGroup = 16;  // output rows per packed group
constexpr int kBlock = 32;  // columns per block
constexpr int kTokens = 8;  // input rows per pass over a group's weights
constexpr int64_t kPrefetch = 4096;
// GGML's type numbers of the blocks this kernel runs.
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8;

template <int TYPE>
struct Layout {
  static constexpr int kBits = TYPE == kQ8_0 ? 8 : TYPE == kQ5_0 || TYPE == kQ5_1 ? 5 : 4;
  static constexpr bool kMin = TYPE == kQ4_1 || TYPE == kQ5_1;  // w = d u + m, else d (u - o)
  static constexpr int32_t kOffset = TYPE == kQ4_0 ? 8 : TYPE == kQ5_0 ? 16 : TYPE == kQ8_0 ? 128 : 0;
  static constexpr int kChunks = kBits == 8 ? 8 : 4;  // 64-byte chunks of quants
  static constexpr int kQuantBytes = kChunks * 64 + (kBits == 5 ? 64 : 0);
  static constexpr int kBytes = kQuantBytes + 2 * kGroup * (kMin ? 2 : 1);
  static constexpr int kRawBytes = 2 + (kMin ? 2 : 0) + 32 * kBits / 8;  // GGUF's block: d, [m], quants
};

// f(std::integral_constant<int, TYPE>) for the GGML type number `type`, one this kernel runs.
template <class F>
auto with_type(int64_t type, const char* op, F&& f) {
  switch (type) {
    case kQ4_0: return f(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int, kQ8_0>{});
  }
  TORCH_CHECK(false, op, ": GGML type ", type, " is not Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7) or Q8_0 (8)");
}

// Each row of x (M, K) to int8 per block (scale absmax / 127) with each block's integer sum.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* xs, int32_t* xsum, Isa isa) {
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
        int32_t sum = 0;
        for (int k = 0; k < kBlock; ++k) sum += out[k];
        xsum[m * blocks + b] = sum;
      }
  });
}

int32_t four_bytes(const int8_t* at) {
  int32_t v;
  std::memcpy(&v, at, 4);
  return v;
}

float half_at(const uint8_t* at) {
  c10::Half h;
  std::memcpy(&h, at, 2);
  return static_cast<float>(h);
}

// out[t][r] = sum over blocks b of (xs[t][b] * d[r][b]) * (dot_b - o * xsum[t][b]) ("_0" types),
// or of xs[t][b] * (d[r][b] * dot_b + m[r][b] * xsum[t][b]) ("_1"), T input rows against one
// group of 16 weight rows.
template <int TYPE, int T>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void tile_avx512(const int8_t* q, int64_t K, const float* xs, const int32_t* xsum, const uint8_t* w, float* out) {
  using L = Layout<TYPE>;
  constexpr int kChains = T == 1 ? 4 : T == 2 ? 2 : 1;  // independent sums where rows are few
  const int64_t blocks = K / kBlock;
  const __m512i nibble = _mm512_set1_epi8(0x0F), fifth_bit = _mm512_set1_epi8(0x10);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* at = w + b * L::kBytes;
    for (int line = 0; line < L::kBytes; line += 64) {  // every line, as kquant_matmul.cpp measured
      _mm_prefetch(reinterpret_cast<const char*>(at + line + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(at + line + 4 * kPrefetch), _MM_HINT_T1);
    }
    __m512i dot[T][kChains];
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < kChains; ++h) dot[t][h] = _mm512_setzero_si512();
    const int8_t* column = q + b * kBlock;
    if constexpr (L::kBits == 8) {
      for (int c = 0; c < L::kChunks; ++c) {
        const __m512i wv = _mm512_loadu_si512(at + c * 64);
        for (int t = 0; t < T; ++t) {
          __m512i& a = dot[t][c % kChains];
          a = _mm512_dpbusd_epi32(a, wv, _mm512_set1_epi32(four_bytes(column + t * K + c * 4)));
        }
      }
    } else {
      // Chunk c's fifth bits at bits 2c, 2c + 1 (16-bit shifts: the masks drop what spills).
      __m512i fifth = L::kBits == 5 ? _mm512_loadu_si512(at + L::kChunks * 64) : _mm512_setzero_si512();
      for (int c = 0; c < L::kChunks; ++c, fifth = _mm512_srli_epi16(fifth, 2)) {
        const __m512i wv = _mm512_loadu_si512(at + c * 64);
        __m512i low = _mm512_and_si512(wv, nibble), high = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nibble);
        if constexpr (L::kBits == 5) {
          low = _mm512_or_si512(low, _mm512_and_si512(_mm512_slli_epi16(fifth, 4), fifth_bit));
          high = _mm512_or_si512(high, _mm512_and_si512(_mm512_slli_epi16(fifth, 3), fifth_bit));
        }
        for (int t = 0; t < T; ++t) {
          __m512i& a = dot[t][(2 * c) % kChains];
          a = _mm512_dpbusd_epi32(a, low, _mm512_set1_epi32(four_bytes(column + t * K + c * 8)));
          __m512i& z = dot[t][(2 * c + 1) % kChains];
          z = _mm512_dpbusd_epi32(z, high, _mm512_set1_epi32(four_bytes(column + t * K + c * 8 + 4)));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + L::kQuantBytes)));
    for (int t = 0; t < T; ++t) {
      __m512i sum = dot[t][0];
      for (int h = 1; h < kChains; ++h) sum = _mm512_add_epi32(sum, dot[t][h]);
      if constexpr (L::kMin) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + L::kQuantBytes + 32)));
        const __m512 part = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(sum)),
                                          _mm512_mul_ps(m, _mm512_set1_ps(static_cast<float>(xsum[t * blocks + b]))));
        acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_set1_ps(xs[t * blocks + b]), part));
      } else {
        sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(L::kOffset * xsum[t * blocks + b]));
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(xs[t * blocks + b]), d);
        acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(sum)));
      }
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + t * kGroup, acc[t]);
}

// The same with AVX2 (VNNI: AVX-VNNI) for U <= 4 input rows and one half of the group (rows
// 8h..8h+7: 8 lanes), its sums in registers beside each row's accumulator. Without VNNI, 4- and
// 5-bit products (at most 31 * 127, two and two) fit maddubs' 16 bits, and Q8_0's signed quants
// multiply as |q| times x with q's sign (at most 128 * 127, two and two), which is
// dot - 128 * sum(x); with VNNI, dpbusd multiplies the unsigned quants as they are.
template <int TYPE, int U, bool VNNI>
__attribute__((target("avx2,f16c")))
void half_avx2(const int8_t* q, int64_t K, const float* xs, const int32_t* xsum, const uint8_t* w, int h, float* out) {
  using L = Layout<TYPE>;
  const int64_t blocks = K / kBlock;
  const __m256i nibble = _mm256_set1_epi8(0x0F), fifth_bit = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  __m256 acc[U];
  for (int t = 0; t < U; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* at = w + b * L::kBytes;
    if (h == 0)
      for (int line = 0; line < L::kBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(at + line + kPrefetch), _MM_HINT_T0);
    const int8_t* column = q + b * kBlock;
    __m256i dot[U];
    for (int t = 0; t < U; ++t) dot[t] = _mm256_setzero_si256();
    if constexpr (L::kBits == 8) {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int c = 0; c < L::kChunks; ++c) {
        const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + c * 64 + h * 32));  // q + 128
        const __m256i s = _mm256_xor_si256(u, flip), size = _mm256_abs_epi8(s);  // q, |q|
        for (int t = 0; t < U; ++t) {
          const __m256i x = speculative::broadcast4(column + t * K + c * 4);
          if constexpr (VNNI)
            dot[t] = speculative::dpbusd_vex(dot[t], u, x);
          else
            dot[t] = speculative::madd_add<false>(dot[t], _mm256_maddubs_epi16(size, _mm256_sign_epi8(x, s)), ones);
        }
      }
    } else {
      __m256i fifth = L::kBits == 5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + L::kChunks * 64 + h * 32))
                                    : _mm256_setzero_si256();
      for (int c = 0; c < L::kChunks; ++c, fifth = _mm256_srli_epi16(fifth, 2)) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + c * 64 + h * 32));
        __m256i low = _mm256_and_si256(wv, nibble), high = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nibble);
        if constexpr (L::kBits == 5) {
          low = _mm256_or_si256(low, _mm256_and_si256(_mm256_slli_epi16(fifth, 4), fifth_bit));
          high = _mm256_or_si256(high, _mm256_and_si256(_mm256_slli_epi16(fifth, 3), fifth_bit));
        }
        for (int t = 0; t < U; ++t) {
          const __m256i x0 = speculative::broadcast4(column + t * K + c * 8);
          const __m256i x1 = speculative::broadcast4(column + t * K + c * 8 + 4);
          if constexpr (VNNI) {
            dot[t] = speculative::dpbusd_vex(speculative::dpbusd_vex(dot[t], low, x0), high, x1);
          } else {
            const __m256i a = _mm256_maddubs_epi16(low, x0), e = _mm256_maddubs_epi16(high, x1);
            dot[t] = speculative::madd_add<false>(dot[t], _mm256_add_epi16(a, e), ones);
          }
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + L::kQuantBytes + h * 16)));
    // Without VNNI, Q8_0's sums are already dot - 128 * sum(x).
    constexpr bool kOffset = L::kBits != 8 || VNNI;
    for (int t = 0; t < U; ++t) {
      if constexpr (L::kMin) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + L::kQuantBytes + 32 + h * 16)));
        const __m256 part = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(dot[t])),
                                          _mm256_mul_ps(m, _mm256_set1_ps(static_cast<float>(xsum[t * blocks + b]))));
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_set1_ps(xs[t * blocks + b]), part));
      } else {
        const __m256i sum =
            kOffset ? _mm256_sub_epi32(dot[t], _mm256_set1_epi32(L::kOffset * xsum[t * blocks + b])) : dot[t];
        const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(xs[t * blocks + b]), d);
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(sum)));
      }
    }
  }
  for (int t = 0; t < U; ++t) _mm256_storeu_ps(out + t * kGroup + h * 8, acc[t]);
}

// T input rows: each half of the group, by passes of up to 4 rows over its weights (from L1
// or L2 after the first: a group's 16 rows hold at most 53 KB in Qwen2.5-Coder 0.5B).
template <int TYPE, int T, bool VNNI>
void tile_avx2(const int8_t* q, int64_t K, const float* xs, const int32_t* xsum, const uint8_t* w, float* out) {
  static_assert(T <= 8);
  const int64_t blocks = K / kBlock;
  for (int h = 0; h < 2; ++h) {
    half_avx2<TYPE, (T < 4 ? T : 4), VNNI>(q, K, xs, xsum, w, h, out);
    if constexpr (T > 4)
      half_avx2<TYPE, T - 4, VNNI>(q + 4 * K, K, xs + 4 * blocks, xsum + 4 * blocks, w, h, out + 4 * kGroup);
  }
}

// Unsigned quant of column k of row r in a packed block.
template <int TYPE>
int32_t quant_at(const uint8_t* at, int r, int k) {
  using L = Layout<TYPE>;
  if constexpr (L::kBits == 8) return at[(k / 4) * 64 + r * 4 + k % 4];
  const int c = k / 8, i = k % 8;
  const uint8_t byte = at[c * 64 + r * 4 + i % 4];
  const int32_t low = i < 4 ? byte & 0x0F : byte >> 4;
  if constexpr (L::kBits == 4) return low;
  const int32_t bit = (at[L::kChunks * 64 + r * 4 + i % 4] >> (2 * c + (i < 4 ? 0 : 1))) & 1;
  return low | (bit << 4);
}

template <int TYPE, int T>
void tile_plain(const int8_t* q, int64_t K, const float* xs, const int32_t* xsum, const uint8_t* w, float* out) {
  using L = Layout<TYPE>;
  const int64_t blocks = K / kBlock;
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < kGroup; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* at = w + b * L::kBytes;
        int32_t dot = 0;
        for (int k = 0; k < kBlock; ++k) dot += quant_at<TYPE>(at, r, k) * int32_t(q[t * K + b * kBlock + k]);
        const float d = half_at(at + L::kQuantBytes + 2 * r);
        if constexpr (L::kMin) {
          const float m = half_at(at + L::kQuantBytes + 32 + 2 * r);
          const float part = d * static_cast<float>(dot) + m * static_cast<float>(xsum[t * blocks + b]);
          acc = acc + xs[t * blocks + b] * part;
        } else {
          const int32_t sum = dot - L::kOffset * xsum[t * blocks + b];
          acc = acc + (xs[t * blocks + b] * d) * static_cast<float>(sum);
        }
      }
      out[t * kGroup + r] = acc;
    }
}

using TileFn = void (*)(const int8_t*, int64_t, const float*, const int32_t*, const uint8_t*, float*);

template <int TYPE, int... T>
TileFn tile_of(Isa isa, int tokens, std::integer_sequence<int, T...>) {
  static const TileFn tiles[4][kTokens] = {{tile_plain<TYPE, T + 1>...}, {tile_avx2<TYPE, T + 1, false>...},
                                           {tile_avx2<TYPE, T + 1, true>...}, {tile_avx512<TYPE, T + 1>...}};
  return tiles[static_cast<int>(isa)][tokens - 1];
}

// One GGUF block of one row -> its 32 unsigned quants, d and m (as halves' bytes; m for "_1" types).
template <int TYPE>
void decode(const uint8_t* raw, uint8_t* quants, uint8_t* d, uint8_t* m) {
  using L = Layout<TYPE>;
  std::memcpy(d, raw, 2);
  if constexpr (L::kMin) std::memcpy(m, raw + 2, 2);
  const uint8_t* rest = raw + (L::kMin ? 4 : 2);
  if constexpr (L::kBits == 8) {  // 32 signed quants
    for (int j = 0; j < 32; ++j) quants[j] = static_cast<uint8_t>(rest[j] ^ 0x80);
  } else {  // [4 bytes of fifth bits (column j's at bit j)], 16 bytes of nibbles (columns j, j + 16)
    uint32_t fifth = 0;
    if constexpr (L::kBits == 5) std::memcpy(&fifth, rest, 4);
    const uint8_t* nibbles = rest + (L::kBits == 5 ? 4 : 0);
    for (int j = 0; j < 16; ++j) {
      quants[j] = (nibbles[j] & 0x0F) | (((fifth >> j) & 1) << 4);
      quants[j + 16] = (nibbles[j] >> 4) | (((fifth >> (j + 16)) & 1) << 4);
    }
  }
}

template <int TYPE>
void pack_group(const uint8_t* raw, int64_t rows, int64_t row_bytes, int64_t blocks, uint8_t* out) {
  using L = Layout<TYPE>;
  uint8_t quants[kBlock];
  for (int64_t b = 0; b < blocks; ++b, out += L::kBytes) {
    std::memset(out, 0, L::kBytes);  // rows past the matrix: zeros
    for (int r = 0; r < rows; ++r) {
      decode<TYPE>(raw + r * row_bytes + b * L::kRawBytes, quants, out + L::kQuantBytes + 2 * r,
                   out + L::kQuantBytes + 32 + 2 * r);
      if constexpr (L::kBits == 8) {
        for (int k = 0; k < kBlock; ++k) out[(k / 4) * 64 + r * 4 + k % 4] = quants[k];
      } else {
        for (int c = 0; c < L::kChunks; ++c)
          for (int i = 0; i < 4; ++i) {
            const int k = c * 8 + i;
            out[c * 64 + r * 4 + i] = (quants[k] & 0x0F) | ((quants[k + 4] & 0x0F) << 4);
            if constexpr (L::kBits == 5)
              out[L::kChunks * 64 + r * 4 + i] |= ((quants[k] >> 4) << (2 * c)) | ((quants[k + 4] >> 4) << (2 * c + 1));
          }
      }
    }
  }
}

}  // namespace

// raw (N, row bytes) uint8: a GGUF tensor's rows of Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 blocks (GGML
// type numbers 2, 3, 6, 7, 8) -> (N_pad / 16, K / 32, block bytes) uint8 in this kernel's layout
// (zero rows to N_pad).
at::Tensor q32_pack(const at::Tensor& raw, int64_t type, int64_t K) {
  return with_type(type, "q32_pack", [&](auto kind) {
    using L = Layout<decltype(kind)::value>;
    TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(),
                "q32_pack: raw blocks must be a contiguous (N, row bytes) uint8 tensor");
    TORCH_CHECK(K > 0 && K % kBlock == 0, "q32_pack: ", K, " columns is not a multiple of ", kBlock);
    const int64_t blocks = K / kBlock, N = raw.size(0), row_bytes = raw.size(1);
    TORCH_CHECK(row_bytes == blocks * L::kRawBytes, "q32_pack: ", row_bytes, " bytes per row do not hold ", K,
                " columns of this type");
    const int64_t groups = (N + kGroup - 1) / kGroup;
    at::Tensor packed = at::empty({groups, blocks, L::kBytes}, raw.options());
    const uint8_t* src = raw.data_ptr<uint8_t>();
    uint8_t* dst = packed.data_ptr<uint8_t>();
    at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        pack_group<decltype(kind)::value>(src + g * kGroup * row_bytes, std::min<int64_t>(kGroup, N - g * kGroup),
                                          row_bytes, blocks, dst + g * blocks * L::kBytes);
    });
    return packed;
  });
}

// x (..., K) float32; packed from q32_pack with the same GGML `type`; bias (N,) or none.
at::Tensor q32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                      const c10::optional<at::Tensor>& bias,
                      int64_t N, const std::string& isa_name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
              packed.is_contiguous(), "q32_linear: float32 x and packed uint8 weights from q32_pack");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "q32_linear runs on CPUs");
  return with_type(type, "q32_linear", [&](auto kind) {
    constexpr int kType = decltype(kind)::value;
    using L = Layout<kType>;
    const int64_t K = x.size(-1), blocks = packed.size(1), Np = packed.size(0) * kGroup;
    TORCH_CHECK(packed.size(2) == L::kBytes && K == blocks * kBlock && N <= Np && Np - N < kGroup,
                "q32_linear: x has ", K, " columns and N = ", N, "; the packed weights do not match");
    const Isa isa = speculative::isa_named(isa_name, "q32_linear");
    const auto [flat, y] = speculative::rows_and_output(x, N);
    const int64_t M = flat.size(0);
    if (M == 0 || N == 0) return y;
    std::vector<int8_t> q(M * K);
    std::vector<float> xs(M * blocks);
    std::vector<int32_t> xsum(M * blocks);
    quantize_rows(flat.data_ptr<float>(), M, K, q.data(), xs.data(), xsum.data(), isa);
    const uint8_t* w = packed.data_ptr<uint8_t>();
    const float* b = bias && bias->defined() ? bias->data_ptr<float>() : nullptr;
    TORCH_CHECK(!b || bias->numel() == N, "q32_linear: bias must have N = ", N, " elements");
    float* out = y.data_ptr<float>();
    const int64_t group_bytes = blocks * L::kBytes;
    speculative::over_groups<kTokens>(M, N, kTokens, b, out, [&](int64_t m0, int tokens, int64_t g, float* sums) {
      tile_of<kType>(isa, tokens, std::make_integer_sequence<int, kTokens>{})(
          q.data() + m0 * K, K, xs.data() + m0 * blocks, xsum.data() + m0 * blocks, w + g * group_bytes, sums);
    });
    return y;
  });
}

TORCH_LIBRARY_FRAGMENT(speculative_kernels, m) {
  m.def("q32_pack(Tensor raw, int type, int k) -> Tensor", &q32_pack);
  m.def("q32_linear(Tensor x, Tensor packed, int type, Tensor? bias, int n, str isa) -> Tensor", &q32_linear);
}
