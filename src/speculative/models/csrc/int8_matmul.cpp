// Width-invariant int8 matrix products for CPUs: y = x W^T (+ b) with W in int8 (a float scale
// per output row) and each row of x quantized to int8 on its own (a float scale per row, its
// absolute maximum at 127). Every output element is one exact int32 sum and the same float
// operations, computed by one thread whatever the number of rows in the call, so a row gets
// the same bits alone or among others, and the same bits on every instruction set below
// (AMX, AVX512-VNNI, AVX2, plain C++).
//
// Weights are packed by groups of 16 output rows: for each 4 input columns, 64 bytes that hold
// the 4 weights of each of the 16 rows (row-major within). One 64-byte load then feeds 16 sums
// at once (VNNI's dpbusd: 16 lanes, each 4 products), so the output needs no horizontal
// reduction and the weights stream from memory in order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "amx.h"
#include "avx2.h"
#include "isa.h"
#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using speculative::Isa;

constexpr int kGroup = 16;   // output rows per packed group
// A tile is one group: 1, 2 or 4 groups per pass over the weights and prefetches of 0, 1, 2 or
// 4 KB were measured on a Zen 4; one group with 1 KB was best (Qwen2.5-Coder 1.5B: 37 ms a row).
constexpr int kTokens = 16;  // input rows per pass (Qwen 1.5B, 9 rows: 105 ms in one pass, 122 in two)
constexpr int64_t kPrefetch = 1024;  // bytes ahead in the weight stream

// Each row of x (M, K) to int8 at scale absmax / 127, into q (M, Kp) (zeros past K); with
// `offset`, q + 128 as unsigned bytes (what VNNI's dpbusd multiplies).
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int8_t* q, float* scale, Isa isa, bool offset) {
  at::parallel_for(0, M, speculative::quantize_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      int8_t* out = q + m * Kp;
      const float peak = speculative::abs_max(row, K, isa);
      std::fill(out, out + Kp, int8_t(0));
      if (!(peak > 0.f) || !std::isfinite(peak)) {  // zeros give 0; inf or nan give nan, as a float product would
        scale[m] = peak == 0.f ? 0.f : std::numeric_limits<float>::quiet_NaN();
      } else {
        speculative::to_int8(row, K, 127.f / peak, out, isa);
        scale[m] = peak / 127.f;
      }
      if (offset)
        for (int64_t k = 0; k < Kp; ++k) out[k] = static_cast<int8_t>(static_cast<uint8_t>(out[k]) ^ 0x80u);
    }
  });
}

// sums[t][r] = sum over k of q[t][k] * W[row r of the group][k], exactly. Here q holds q + 128
// as unsigned bytes (VNNI multiplies unsigned by signed); 128 * sum(w) comes off at the end.
template <int T>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void tile_avx512(const int8_t* q, int64_t Kp, const int8_t* w, const int32_t* wsum, int32_t* sums) {
  __m512i acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp; k += 4) {
    const int8_t* at = w + k * kGroup;
    const __m512i wv = _mm512_loadu_si512(at);
    _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetch), _MM_HINT_T0);
    for (int t = 0; t < T; ++t) {
      int32_t four;
      std::memcpy(&four, q + t * Kp + k, 4);
      acc[t] = _mm512_dpbusd_epi32(acc[t], _mm512_set1_epi32(four), wv);  // a broadcast from memory
    }
  }
  const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(wsum), 7);
  for (int t = 0; t < T; ++t) _mm512_storeu_si512(sums + t * kGroup, _mm512_sub_epi32(acc[t], offset));
}

// The same with AVX2 (VNNI: AVX-VNNI) for U <= 8 input rows and one half of the group (rows
// 8h..8h+7: 8 lanes), one sum register a row. Without VNNI: |w| times x with w's sign, pairs of
// products of at most 127 * 127 (no int16 overflow); with VNNI, q + 128 as with AVX512-VNNI.
template <int U, bool VNNI>
__attribute__((target("avx2")))
void half_avx2(const int8_t* q, int64_t Kp, const int8_t* w, const int32_t* wsum, int h, int32_t* sums) {
  __m256i acc[U];
  for (int t = 0; t < U; ++t) acc[t] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < Kp; k += 4) {
    const int8_t* at = w + k * kGroup;
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + h * 32));
    if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetch), _MM_HINT_T0);
    if constexpr (VNNI) {
      for (int t = 0; t < U; ++t) acc[t] = speculative::dpbusd_vex(acc[t], speculative::broadcast4(q + t * Kp + k), wv);
    } else {
      const __m256i size = _mm256_abs_epi8(wv);
      for (int t = 0; t < U; ++t) {
        const __m256i pairs = _mm256_maddubs_epi16(size, _mm256_sign_epi8(speculative::broadcast4(q + t * Kp + k), wv));
        acc[t] = speculative::madd_add<false>(acc[t], pairs, ones);
      }
    }
  }
  const __m256i offset = VNNI ? _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wsum + h * 8)), 7)
                              : _mm256_setzero_si256();
  for (int t = 0; t < U; ++t)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + t * kGroup + h * 8), _mm256_sub_epi32(acc[t], offset));
}

// T input rows: each half of the group, by passes of up to 8 rows over its weights (from L1 or L2
// after the first: 16 rows of Qwen2.5-Coder 1.5B's down projection hold 140 KB).
template <int T, bool VNNI>
void tile_avx2(const int8_t* q, int64_t Kp, const int8_t* w, const int32_t* wsum, int32_t* sums) {
  static_assert(T <= 16);
  for (int h = 0; h < 2; ++h) {
    half_avx2<(T < 8 ? T : 8), VNNI>(q, Kp, w, wsum, h, sums);
    if constexpr (T > 8) half_avx2<T - 8, VNNI>(q + 8 * Kp, Kp, w, wsum, h, sums + 8 * kGroup);
  }
}

template <int T>
void tile_plain(const int8_t* q, int64_t Kp, const int8_t* w, const int32_t*, int32_t* sums) {
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < kGroup; ++r) {
      int32_t dot = 0;
      for (int64_t k = 0; k < Kp; ++k) dot += int32_t(q[t * Kp + k]) * int32_t(w[(k / 4) * 64 + r * 4 + k % 4]);
      sums[t * kGroup + r] = dot;
    }
}

// AMX (amx.h): the packed layout (K/4, 16, 4) of a group is the layout of a tile's 4-byte
// column groups, so 64 columns of it are 1 KB in order. Signed times signed: no offset. Exact
// sums, so the same bits as on VNNI. "auto" takes it where the CPU has it: one row costs what it
// costs on VNNI, 16 rows little more (on VNNI, Qwen 1.5B's layers and Gemma 3's output layer
// cost 1.3-3.3x at 16 rows what they do at 1). Tiles: 0-2 a full pass of 16 rows (sums,
// activations, weights), 3-4 the last pass of fewer rows, 5-7 the columns past the last whole
// 64 (full pass, weights, last pass).
void amx_configure(int64_t M, int64_t Kp) {
  speculative::TileShapes shapes;
  const int64_t full = M >= kTokens ? kTokens : 0, last = M % kTokens, rest = Kp % 64;
  shapes.set(0, full, 64), shapes.set(1, full, 64), shapes.set(2, 16, 64);
  shapes.set(3, last, 64), shapes.set(4, last, 64);
  shapes.set(5, full, rest), shapes.set(6, rest / 4, 64), shapes.set(7, last, rest);
  speculative::amx_load(shapes);
}

#if SPECULATIVE_AMX
// sums (rows, 16) of one pass: q's rows (stride Kp) against one group w (K/4, 16, 4); `whole`
// columns by tiles of 64, then the rest. Tile numbers are literals in AMX's instructions.
#define AMX_PASS(NAME, SUMS, ROWS, ROWS_REST)                                                          \
  __attribute__((target("amx-tile,amx-int8"))) void NAME(const int8_t* q, int64_t Kp, int64_t whole,      \
                                                          const int8_t* w, int32_t* sums) {               \
    _tile_zero(SUMS);                                                                                  \
    for (int64_t k = 0; k < whole; k += 64) {                                                          \
      _tile_loadd(ROWS, q + k, Kp);                                                                    \
      _tile_loadd(2, w + k * kGroup, 64);                                                              \
      _tile_dpbssd(SUMS, ROWS, 2);                                                                     \
    }                                                                                                  \
    if (whole < Kp) {                                                                                  \
      _tile_loadd(ROWS_REST, q + whole, Kp);                                                           \
      _tile_loadd(6, w + whole * kGroup, 64);                                                          \
      _tile_dpbssd(SUMS, ROWS_REST, 6);                                                                \
    }                                                                                                  \
    _tile_stored(SUMS, sums, kGroup * sizeof(int32_t));                                                \
  }
AMX_PASS(amx_pass_full, 0, 1, 5)
AMX_PASS(amx_pass_last, 3, 4, 7)
#undef AMX_PASS
#else
void amx_pass_full(const int8_t*, int64_t, int64_t, const int8_t*, int32_t*) {}
void amx_pass_last(const int8_t*, int64_t, int64_t, const int8_t*, int32_t*) {}
#endif

using TileFn = void (*)(const int8_t*, int64_t, const int8_t*, const int32_t*, int32_t*);

#define TILES(NAME, ...)                                                                                  \
  {NAME<1, ##__VA_ARGS__>, NAME<2, ##__VA_ARGS__>, NAME<3, ##__VA_ARGS__>, NAME<4, ##__VA_ARGS__>,              \
   NAME<5, ##__VA_ARGS__>, NAME<6, ##__VA_ARGS__>, NAME<7, ##__VA_ARGS__>, NAME<8, ##__VA_ARGS__>,              \
   NAME<9, ##__VA_ARGS__>, NAME<10, ##__VA_ARGS__>, NAME<11, ##__VA_ARGS__>, NAME<12, ##__VA_ARGS__>,           \
   NAME<13, ##__VA_ARGS__>, NAME<14, ##__VA_ARGS__>, NAME<15, ##__VA_ARGS__>, NAME<16, ##__VA_ARGS__>}

TileFn tile_for(Isa isa, int tokens) {
  static const TileFn tiles[4][kTokens] = {TILES(tile_plain), TILES(tile_avx2, false), TILES(tile_avx2, true),
                                           TILES(tile_avx512)};
  return tiles[static_cast<int>(isa)][tokens - 1];
}

}  // namespace

// x (..., K) float32; packed (N_pad / 16, K_pad / 4, 16, 4) int8 (int8_pack below); scale and
// wsum (N_pad,) float32 and int32 (the rows' sums); bias (N,) float32 or none. -> (..., N) float32.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& wsum,
                       const c10::optional<at::Tensor>& bias, int64_t N, const std::string& isa_name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat &&
              wsum.scalar_type() == at::kInt, "int8_linear: float32 x, int8 packed weights, float32 scale, int32 wsum");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "int8_linear runs on CPUs");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kGroup && packed.size(3) == 4 && packed.is_contiguous(),
              "int8_linear: packed weights must be contiguous (N/16, K/4, 16, 4)");
  const int64_t Np = packed.size(0) * kGroup, Kp = packed.size(1) * 4, K = x.size(-1);
  TORCH_CHECK(K <= Kp && Kp - K < 4 && N <= Np && Np - N < kGroup, "int8_linear: x has ", K,
              " columns and N = ", N, "; the packed weights hold ", Np, " x ", Kp);
  TORCH_CHECK(Np % kGroup == 0 && scale.numel() == Np && wsum.numel() == Np, "int8_linear: bad padding");
  const at::Tensor flat = x.reshape({-1, K}).contiguous();
  const int64_t M = flat.size(0);
  TORCH_CHECK(isa_name != "amx" || speculative::amx_usable(),
              "int8_linear: this CPU has no AMX-INT8 (or Linux does not lend it)");
  const bool amx = isa_name == "amx" || isa_name == "auto" && speculative::amx_allowed();
  const Isa isa = amx ? Isa::avx512_vnni : speculative::isa_named(isa_name, "int8_linear");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> q(M * Kp);
  std::vector<float> xscale(M);
  quantize_rows(flat.data_ptr<float>(), M, K, Kp, q.data(), xscale.data(), isa,
                !amx && (isa == Isa::avx512_vnni || isa == Isa::avx_vnni));
  const int8_t* wdata = packed.data_ptr<int8_t>();
  const float* wscale = scale.data_ptr<float>();
  const int32_t* sums_of_rows = wsum.data_ptr<int32_t>();
  const float* b = bias && bias->defined() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  const int64_t tiles = Np / kGroup;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    int32_t sums[kTokens * kGroup];
    if (amx) amx_configure(M, Kp);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kGroup;
      for (int64_t m0 = 0; m0 < M; m0 += kTokens) {
        const int tokens = static_cast<int>(std::min<int64_t>(kTokens, M - m0));
        if (amx)
          (tokens == kTokens ? amx_pass_full : amx_pass_last)(q.data() + m0 * Kp, Kp, Kp / 64 * 64, wdata + n0 * Kp,
                                                              sums);
        else
          tile_for(isa, tokens)(q.data() + m0 * Kp, Kp, wdata + n0 * Kp, sums_of_rows + n0, sums);
        const int64_t width = std::min<int64_t>(kGroup, N - n0);
        for (int t = 0; t < tokens; ++t) {  // branch-free loops, which the compiler vectorizes
          const float xs = xscale[m0 + t];
          const int32_t* sum = sums + t * kGroup;
          float* row = out + (m0 + t) * N + n0;
          if (b)
            for (int64_t r = 0; r < width; ++r) row[r] = static_cast<float>(sum[r]) * (xs * wscale[n0 + r]) + b[n0 + r];
          else
            for (int64_t r = 0; r < width; ++r) row[r] = static_cast<float>(sum[r]) * (xs * wscale[n0 + r]);
        }
      }
    }
    if (amx) speculative::amx_release();
  });
  return y;
}

// weight (N, K) int8 -> (packed (N_pad / 16, K_pad / 4, 16, 4), row sums (N_pad,) int32), zero-padded
// to whole groups of 16 rows and to a multiple of 4 columns.
std::tuple<at::Tensor, at::Tensor> int8_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, "int8_pack: weight must be (N, K) int8");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t Np = (N + kGroup - 1) / kGroup * kGroup, Kp = (K + 3) / 4 * 4;
  at::Tensor packed = at::empty({Np / kGroup, Kp / 4, kGroup, 4}, w.options());
  at::Tensor wsum = at::empty({Np}, w.options().dtype(at::kInt));
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* sums = wsum.data_ptr<int32_t>();
  at::parallel_for(0, Np / kGroup, 16, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> rows(kGroup * Kp);  // the group's rows, zero-padded
    for (int64_t g = begin; g < end; ++g) {
      std::fill(rows.begin(), rows.end(), int8_t(0));
      for (int r = 0; r < kGroup; ++r) {
        const int64_t n = g * kGroup + r;
        int32_t sum = 0;
        if (n < N) {
          std::memcpy(rows.data() + r * Kp, src + n * K, K);
          for (int64_t k = 0; k < K; ++k) sum += src[n * K + k];
        }
        sums[n] = sum;
      }
      int8_t* out = dst + g * Kp * kGroup;
      for (int64_t k = 0; k < Kp; k += 4)
        for (int r = 0; r < kGroup; ++r, out += 4) std::memcpy(out, rows.data() + r * Kp + k, 4);
    }
  });
  return {packed, wsum};
}

// The instruction set "auto" takes here: the best this CPU runs at or below the ceiling.
std::string isa() { return speculative::kIsaNames[speculative::best_level()]; }

// Sets the ceiling of "auto" (models/isa.py: SPECULATIVE_ISA); refuses what this CPU does not run.
std::string set_isa(const std::string& name) {
  const int level = speculative::level_named(name, "set_isa");
  TORCH_CHECK(speculative::cpu_runs(level), "set_isa: this CPU does not run ", name);
  speculative::isa_ceiling().store(level);
  return isa();
}

TORCH_LIBRARY(speculative_kernels, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor wsum, Tensor? bias, int n, str isa) -> Tensor",
        &int8_linear);
  m.def("int8_pack(Tensor weight) -> (Tensor, Tensor)", &int8_pack);
  m.def("isa() -> str", &isa);
  m.def("set_isa(str name) -> str", &set_isa);
}
