#include "row_dot.h"

#include <cstring>

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

// int4: per group of 32, 4 words of 8 weights; weight j of a word at bit i4_nibble_pos(j).
TI_AVX2 static float dot_i4(const float* x, const QuantMatrix& m, int64_t r) {
  const __m256i shifts = _mm256_setr_epi32(i4_nibble_pos(0), i4_nibble_pos(1), i4_nibble_pos(2), i4_nibble_pos(3),
                                           i4_nibble_pos(4), i4_nibble_pos(5), i4_nibble_pos(6), i4_nibble_pos(7));
  const __m256i nibble = _mm256_set1_epi32(0xF);
  const int64_t groups = m.K / kI4Group;
  const uint8_t* q = &m.q[(size_t)(r * m.ld)];
  const uint16_t* sm = &m.sm[(size_t)(r * groups * 2)];
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const __m256 s = _mm256_set1_ps(half_to_float(sm[2 * g])), mn = _mm256_set1_ps(half_to_float(sm[2 * g + 1]));
    for (int w = 0; w < kI4Group / 8; w++) {
      int32_t word;
      std::memcpy(&word, q + g * kI4Group / 2 + w * 4, 4);
      const __m256i qi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), nibble);
      acc = step(acc, x + g * kI4Group + w * 8, _mm256_add_ps(_mm256_mul_ps(s, _mm256_cvtepi32_ps(qi)), mn));
    }
  }
  return reduce8(acc);
}

// int8: per block of 32, d (q - 128); only whole blocks (K % 32 == 0).
TI_AVX2 static float dot_i8(const float* x, const QuantMatrix& m, int64_t r) {
  const int64_t blocks = m.ld / kI8Block;
  const uint8_t* q = &m.q[(size_t)(r * m.ld)];
  const __m256i bias = _mm256_set1_epi32(128);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const __m256 d = _mm256_set1_ps(half_to_float(m.sm[(size_t)(r * blocks + b)]));
    for (int i = 0; i < kI8Block; i += 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + b * kI8Block + i));
      const __m256i qi = _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), bias);
      acc = step(acc, x + b * kI8Block + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(qi)));
    }
  }
  return reduce8(acc);
}

// fp16: F16C's conversion is exact (the table's numbers); K % 8 == 0.
TI_AVX2 static float dot_f16(const float* x, const uint16_t* h, int64_t K) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < K; i += 8)
    acc = step(acc, x + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  return reduce8(acc);
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

static bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return yes;
}

bool row_dots(const HostTensor& W, const float* x, float* y, int64_t r0, int64_t r1) {
  const int64_t K = W.cols();
  if (!have_avx2()) return false;
  if (W.held == Held::I4 && K % kI4Group == 0) {
    for (int64_t r = r0; r < r1; r++) y[r - r0] = dot_i4(x, W.blocks, r);
  } else if (W.held == Held::I8 && K % kI8Block == 0) {
    for (int64_t r = r0; r < r1; r++) y[r - r0] = dot_i8(x, W.blocks, r);
  } else if (W.held == Held::F16 && K % 8 == 0) {
    for (int64_t r = r0; r < r1; r++) y[r - r0] = dot_f16(x, &W.bits[(size_t)(r * K)], K);
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

#else
bool row_dots(const HostTensor&, const float*, float*, int64_t, int64_t) { return false; }
bool row_dots8(const float*, const float*, int64_t, float*) { return false; }
#endif

}  // namespace ti
