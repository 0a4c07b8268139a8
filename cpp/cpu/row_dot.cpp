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

// The products below take R rows at once: each row's sum is one chain of dependent adds, so R chains keep the
// adders busy where one waits on its last add; each row still adds in its own order (the same numbers), and the
// input is loaded once for the R.

// int4: per group of 32, 4 words of 8 weights; weight j of a word at bit i4_nibble_pos(j).
template <int R>
TI_AVX2 static void dot_i4(const float* x, const QuantMatrix& m, int64_t r, float* y) {
  const __m256i shifts = _mm256_setr_epi32(i4_nibble_pos(0), i4_nibble_pos(1), i4_nibble_pos(2), i4_nibble_pos(3),
                                           i4_nibble_pos(4), i4_nibble_pos(5), i4_nibble_pos(6), i4_nibble_pos(7));
  const __m256i nibble = _mm256_set1_epi32(0xF);
  const int64_t groups = m.K / kI4Group;
  __m256 acc[R];
  for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m256 s[R], mn[R];
    for (int i = 0; i < R; i++) {
      const uint16_t* sm = &m.sm[(size_t)(((r + i) * groups + g) * 2)];
      s[i] = _mm256_set1_ps(half(sm[0]));
      mn[i] = _mm256_set1_ps(half(sm[1]));
    }
    for (int w = 0; w < kI4Group / 8; w++) {
      const __m256 xv = _mm256_loadu_ps(x + g * kI4Group + w * 8);
      for (int i = 0; i < R; i++) {
        int32_t word;
        std::memcpy(&word, &m.q[(size_t)((r + i) * m.ld + g * kI4Group / 2 + w * 4)], 4);
        const __m256i qi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), nibble);
        const __m256 wv = _mm256_add_ps(_mm256_mul_ps(s[i], _mm256_cvtepi32_ps(qi)), mn[i]);
        acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(xv, wv));
      }
    }
  }
  for (int i = 0; i < R; i++) y[i] = reduce8(acc[i]);
}

// int8: per block of 32, d (q - 128); only whole blocks (K % 32 == 0).
template <int R>
TI_AVX2 static void dot_i8(const float* x, const QuantMatrix& m, int64_t r, float* y) {
  const int64_t blocks = m.ld / kI8Block;
  const __m256i bias = _mm256_set1_epi32(128);
  __m256 acc[R];
  for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    __m256 d[R];
    for (int i = 0; i < R; i++) d[i] = _mm256_set1_ps(half(m.sm[(size_t)((r + i) * blocks + b)]));
    for (int j = 0; j < kI8Block; j += 8) {
      const __m256 xv = _mm256_loadu_ps(x + b * kI8Block + j);
      for (int i = 0; i < R; i++) {
        const __m128i bytes =
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&m.q[(size_t)((r + i) * m.ld + b * kI8Block + j)]));
        const __m256i qi = _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), bias);
        acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(xv, _mm256_mul_ps(d[i], _mm256_cvtepi32_ps(qi))));
      }
    }
  }
  for (int i = 0; i < R; i++) y[i] = reduce8(acc[i]);
}

// fp16: F16C's conversion is exact (the table's numbers); K % 8 == 0.
template <int R>
TI_AVX2 static void dot_f16(const float* x, const uint16_t* h, int64_t K, float* y) {
  __m256 acc[R];
  for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (int i = 0; i < R; i++)
      acc[i] = _mm256_add_ps(
          acc[i], _mm256_mul_ps(xv, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i * K + k)))));
  }
  for (int i = 0; i < R; i++) y[i] = reduce8(acc[i]);
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

// Rows [r0, r1) by 4 at a time, then one at a time.
template <typename Dot>
TI_AVX2 static void by_fours(int64_t r0, int64_t r1, float* y, Dot dot) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) dot(std::integral_constant<int, 4>(), r, y + (r - r0));
  for (; r < r1; r++) dot(std::integral_constant<int, 1>(), r, y + (r - r0));
}

bool row_dots(const HostTensor& W, const float* x, float* y, int64_t r0, int64_t r1) {
  const int64_t K = W.cols();
  if (!have_avx2()) return false;
  if (W.held == Held::I4 && K % kI4Group == 0) {
    by_fours(r0, r1, y, [&](auto n, int64_t r, float* out) { dot_i4<decltype(n)::value>(x, W.blocks, r, out); });
  } else if (W.held == Held::I8 && K % kI8Block == 0) {
    by_fours(r0, r1, y, [&](auto n, int64_t r, float* out) { dot_i8<decltype(n)::value>(x, W.blocks, r, out); });
  } else if (W.held == Held::F16 && K % 8 == 0) {
    by_fours(r0, r1, y, [&](auto n, int64_t r, float* out) {
      dot_f16<decltype(n)::value>(x, &W.bits[(size_t)(r * K)], K, out);
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
bool row_dots(const HostTensor&, const float*, float*, int64_t, int64_t) { return false; }
bool row_dots8(const float*, const float*, int64_t, float*) { return false; }
#endif

}  // namespace ti
