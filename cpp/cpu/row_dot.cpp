#include "row_dot.h"

#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TI_ROW_DOT_AVX2 1
#endif

namespace ti {

#ifdef TI_ROW_DOT_AVX2
#define TI_AVX2 __attribute__((target("avx2,f16c")))  // (not "fma": a fused multiply-add would change numbers)

// dot()'s reduction of its 8 partial sums.
TI_AVX2 static float reduce8(__m256 acc) {
  float a[8];
  _mm256_storeu_ps(a, acc);
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

TI_AVX2 static __m256 step(__m256 acc, const float* x, __m256 w) {
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(x), w));
}

// fp16 bits -> fp32 by F16C: exact, half_to_float()'s numbers (a scale a group: the call cost more than its group).
TI_AVX2 static inline float half(uint16_t h) { return _cvtsh_ss(h); }

// The products below take R rows and N inputs at once: each (row, input) sum is one chain of dependent adds, so
// R x N chains keep the adders busy where one waits on its last add; each row's weights are unpacked once for the
// N inputs, and each input loaded once for the R rows. Every sum still adds in its own order: the same numbers as
// one row and one input at a time. y[t * ldy + i] = x_t . W[r + i], x_t = x + t * K.

// int4: per group of 32, 4 words of 8 weights; weight j of a word at bit i4_nibble_pos(j).
template <int R, int N>
TI_AVX2 static void dot_i4(const float* x, const QuantMatrix& m, int64_t r, float* y, int64_t ldy) {
  const __m256i shifts = _mm256_setr_epi32(i4_nibble_pos(0), i4_nibble_pos(1), i4_nibble_pos(2), i4_nibble_pos(3),
                                           i4_nibble_pos(4), i4_nibble_pos(5), i4_nibble_pos(6), i4_nibble_pos(7));
  const __m256i nibble = _mm256_set1_epi32(0xF);
  const int64_t K = m.K, groups = K / kI4Group;
  __m256 acc[R][N];
  for (int i = 0; i < R; i++)
    for (int t = 0; t < N; t++) acc[i][t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m256 s[R], mn[R];
    for (int i = 0; i < R; i++) {
      const uint16_t* sm = &m.sm[(size_t)(((r + i) * groups + g) * 2)];
      s[i] = _mm256_set1_ps(half(sm[0]));
      mn[i] = _mm256_set1_ps(half(sm[1]));
    }
    for (int w = 0; w < kI4Group / 8; w++) {
      __m256 wv[R];
      for (int i = 0; i < R; i++) {
        int32_t word;
        std::memcpy(&word, &m.q[(size_t)((r + i) * m.ld + g * kI4Group / 2 + w * 4)], 4);
        const __m256i qi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), nibble);
        wv[i] = _mm256_add_ps(_mm256_mul_ps(s[i], _mm256_cvtepi32_ps(qi)), mn[i]);
      }
      for (int t = 0; t < N; t++) {
        const float* xt = x + t * K + g * kI4Group + w * 8;
        for (int i = 0; i < R; i++) acc[i][t] = step(acc[i][t], xt, wv[i]);
      }
    }
  }
  for (int i = 0; i < R; i++)
    for (int t = 0; t < N; t++) y[t * ldy + i] = reduce8(acc[i][t]);
}

// int8: per block of 32, d (q - 128); only whole blocks (K % 32 == 0).
template <int R, int N>
TI_AVX2 static void dot_i8(const float* x, const QuantMatrix& m, int64_t r, float* y, int64_t ldy) {
  const int64_t K = m.K, blocks = m.ld / kI8Block;
  const __m256i bias = _mm256_set1_epi32(128);
  __m256 acc[R][N];
  for (int i = 0; i < R; i++)
    for (int t = 0; t < N; t++) acc[i][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    __m256 d[R];
    for (int i = 0; i < R; i++) d[i] = _mm256_set1_ps(half(m.sm[(size_t)((r + i) * blocks + b)]));
    for (int j = 0; j < kI8Block; j += 8) {
      __m256 wv[R];
      for (int i = 0; i < R; i++) {
        const __m128i bytes =
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&m.q[(size_t)((r + i) * m.ld + b * kI8Block + j)]));
        wv[i] = _mm256_mul_ps(d[i], _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), bias)));
      }
      for (int t = 0; t < N; t++) {
        const float* xt = x + t * K + b * kI8Block + j;
        for (int i = 0; i < R; i++) acc[i][t] = step(acc[i][t], xt, wv[i]);
      }
    }
  }
  for (int i = 0; i < R; i++)
    for (int t = 0; t < N; t++) y[t * ldy + i] = reduce8(acc[i][t]);
}

// fp16: F16C's conversion is exact (the table's numbers); K % 8 == 0.
template <int R, int N>
TI_AVX2 static void dot_f16(const float* x, const uint16_t* bits, int64_t K, int64_t r, float* y, int64_t ldy) {
  __m256 acc[R][N];
  for (int i = 0; i < R; i++)
    for (int t = 0; t < N; t++) acc[i][t] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[R];
    for (int i = 0; i < R; i++)
      wv[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + (r + i) * K + k)));
    for (int t = 0; t < N; t++)
      for (int i = 0; i < R; i++) acc[i][t] = step(acc[i][t], x + t * K + k, wv[i]);
  }
  for (int i = 0; i < R; i++)
    for (int t = 0; t < N; t++) y[t * ldy + i] = reduce8(acc[i][t]);
}

// Eight inputs at once (eight independent chains, each weight loaded once for the eight).
TI_AVX2 static void dots8(const float* w, const float* x, int64_t K, float out[8]) {
  __m256 acc[8];
  for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < K; i += 8) {
    const __m256 wv = _mm256_loadu_ps(w + i);
    for (int t = 0; t < 8; t++) acc[t] = step(acc[t], x + t * K + i, wv);
  }
  for (int t = 0; t < 8; t++) out[t] = reduce8(acc[t]);
}

// out[0, 8 * C) += sum over rows of w[r] * v[r][0, 8 * C), C registers of out held across the rows.
template <int C>
TI_AVX2 static void add_weighted_chunk(float* out, const float* v, const float* w, int64_t rows, int64_t hd) {
  __m256 acc[C];
  for (int c = 0; c < C; c++) acc[c] = _mm256_loadu_ps(out + 8 * c);
  for (int64_t r = 0; r < rows; r++) {
    const __m256 wr = _mm256_set1_ps(w[r]);
    for (int c = 0; c < C; c++) acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(wr, _mm256_loadu_ps(v + r * hd + 8 * c)));
  }
  for (int c = 0; c < C; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

static bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return yes;
}

// Rows [r0, r1) for the N inputs: R at a time, then one at a time. (R x N accumulators, R unpacked weight
// vectors and the constants fit AVX2's 16 registers: 4 x 1, 2 x 2..4, 1 x 8.)
template <int N, typename Dot>
TI_AVX2 static void rows_for(int64_t r0, int64_t r1, float* y, Dot dot) {
  constexpr int R = N == 1 ? 4 : N >= 8 ? 1 : 2;
  int64_t r = r0;
  for (; r + R <= r1; r += R) dot(std::integral_constant<int, R>(), std::integral_constant<int, N>(), r, y + (r - r0));
  for (; r < r1; r++) dot(std::integral_constant<int, 1>(), std::integral_constant<int, N>(), r, y + (r - r0));
}

// The n inputs eight at a time, then four, then the rest together (a row unpacked once for eight inputs rather
// than twice for four: docs/perf/cpu-engine.md).
template <typename Dot>
TI_AVX2 static void inputs_for(int64_t n, int64_t K, const float* x, float* y, int64_t ldy, int64_t r0, int64_t r1,
                               Dot dot) {
  int64_t t = 0;
  auto run = [&](auto N) {
    rows_for<decltype(N)::value>(r0, r1, y + t * ldy, [&](auto R, auto Nc, int64_t r, float* out) {
      dot(R, Nc, x + t * K, r, out);
    });
  };
  for (; t + 8 <= n; t += 8) run(std::integral_constant<int, 8>());
  for (; t + 4 <= n; t += 4) run(std::integral_constant<int, 4>());
  switch (n - t) {
    case 3: run(std::integral_constant<int, 3>()); break;
    case 2: run(std::integral_constant<int, 2>()); break;
    case 1: run(std::integral_constant<int, 1>()); break;
    default: break;
  }
}

bool row_dots(const HostTensor& W, const float* x, int64_t n, float* y, int64_t ldy, int64_t r0, int64_t r1) {
  const int64_t K = W.cols();
  if (!have_avx2()) return false;
  if (W.held == Held::I4 && K % kI4Group == 0) {
    inputs_for(n, K, x, y, ldy, r0, r1, [&](auto R, auto N, const float* xt, int64_t r, float* out) {
      dot_i4<decltype(R)::value, decltype(N)::value>(xt, W.blocks, r, out, ldy);
    });
  } else if (W.held == Held::I8 && K % kI8Block == 0) {
    inputs_for(n, K, x, y, ldy, r0, r1, [&](auto R, auto N, const float* xt, int64_t r, float* out) {
      dot_i8<decltype(R)::value, decltype(N)::value>(xt, W.blocks, r, out, ldy);
    });
  } else if (W.held == Held::F16 && K % 8 == 0) {
    inputs_for(n, K, x, y, ldy, r0, r1, [&](auto R, auto N, const float* xt, int64_t r, float* out) {
      dot_f16<decltype(R)::value, decltype(N)::value>(xt, W.bits.data(), K, r, out, ldy);
    });
  } else {
    return false;
  }
  return true;
}

bool row_dots8(const float* w, const float* x, int64_t K, float out[8]) {
  if (!have_avx2() || K % 8 != 0) return false;
  dots8(w, x, K, out);
  return true;
}

bool add_weighted_rows(float* out, const float* v, const float* w, int64_t rows, int64_t hd) {
  if (!have_avx2() || hd % 8 != 0) return false;
  int64_t i = 0;
  for (; i + 64 <= hd; i += 64) add_weighted_chunk<8>(out + i, v + i, w, rows, hd);
  for (; i < hd; i += 8) add_weighted_chunk<1>(out + i, v + i, w, rows, hd);
  return true;
}

#else
bool add_weighted_rows(float*, const float*, const float*, int64_t, int64_t) { return false; }
bool row_dots(const HostTensor&, const float*, int64_t, float*, int64_t, int64_t, int64_t) { return false; }
bool row_dots8(const float*, const float*, int64_t, float*) { return false; }
#endif

}  // namespace ti
