#include "quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "errors.h"
#include "weights.h"  // half_to_float, float_to_half

namespace ti {

WFormat wformat_from_string(const std::string& s) {
  if (s == "fp16" || s == "f16") return WFormat::F16;
  if (s == "int8" || s == "i8") return WFormat::I8;
  if (s == "int4" || s == "i4") return WFormat::I4;
  fail(ErrorKind::Request, "unknown weight format '" + s + "' (fp16 | int8 | int4)");
}

std::string to_string(WFormat f) { return f == WFormat::F16 ? "fp16" : f == WFormat::I8 ? "int8" : "int4"; }

int64_t quant_bytes(WFormat f, int64_t rows, int64_t K) {
  if (f == WFormat::F16) return rows * ((K + 7) / 8 * 8) * 2;
  return rows * quant_ld(f, K) + rows * scale_halves(f, K) * 2;
}

void require_int4_widths(int64_t hidden, int64_t q_dim, int64_t intermediate) {
  for (int64_t K : {hidden, q_dim, intermediate})
    if (K % kI4Group != 0)
      fail(ErrorKind::Unsupported, "int4 weights need hidden, n_heads * head_dim and intermediate to be "
                                   "multiples of 32 (this model has " + std::to_string(hidden) + ", " +
                                   std::to_string(q_dim) + ", " + std::to_string(intermediate) + ")");
}

static float round_half(float x) { return half_to_float(float_to_half(x)); }

// One block of n <= 32 weights (the rest of the block is zero padding) as llama.cpp's quantize_row_q8_0 does it:
// its numbers exactly (fp32 d and its reciprocal; roundf; d rounded to fp16 only when stored).
static uint16_t quantize_i8_block(const float* v, int n, uint8_t* u) {
  float amax = 0.0f;
  for (int i = 0; i < n; i++) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int i = 0; i < n; i++) u[i] = (uint8_t)((int)std::roundf(v[i] * id) + 128);  // |q| <= 127: no clamp
  return float_to_half(d);
}

static void quantize_i8(QuantMatrix& m, const float* w) {
  const int64_t blocks = m.ld / kI8Block;
  m.q.assign((size_t)(m.rows * m.ld), 128);
  m.sm.resize((size_t)(m.rows * blocks));
  float v[kI8Block];
  for (int64_t r = 0; r < m.rows; r++)
    for (int64_t b = 0; b < blocks; b++) {
      const int n = (int)std::min<int64_t>(kI8Block, m.K - b * kI8Block);
      for (int i = 0; i < n; i++) v[i] = round_half(w[r * m.K + b * kI8Block + i]);
      m.sm[(size_t)(r * blocks + b)] = quantize_i8_block(v, n, &m.q[(size_t)(r * m.ld + b * kI8Block)]);
    }
}

static void quantize_i4(QuantMatrix& m, const float* w) {
  const int64_t groups = m.K / kI4Group;
  m.q.assign((size_t)(m.rows * m.ld), 0);
  m.sm.resize((size_t)(m.rows * groups * 2));
  for (int64_t r = 0; r < m.rows; r++) {
    for (int64_t g = 0; g < groups; g++) {
      float lo = INFINITY, hi = -INFINITY, v[kI4Group];
      for (int i = 0; i < kI4Group; i++) {
        v[i] = round_half(w[r * m.K + g * kI4Group + i]);
        lo = std::min(lo, v[i]);
        hi = std::max(hi, v[i]);
      }
      const uint16_t sh = float_to_half((hi - lo) / 15.0f), mh = float_to_half(lo);
      const float s = half_to_float(sh), mn = half_to_float(mh);
      m.sm[(size_t)((r * groups + g) * 2)] = sh;
      m.sm[(size_t)((r * groups + g) * 2 + 1)] = mh;
      uint32_t* words = reinterpret_cast<uint32_t*>(&m.q[(size_t)(r * m.ld + g * kI4Group / 2)]);
      for (int i = 0; i < kI4Group; i++) {
        const float q = s > 0.0f ? std::min(15.0f, std::max(0.0f, std::rint((v[i] - mn) / s))) : 0.0f;
        words[i / 8] |= (uint32_t)q << i4_nibble_pos(i % 8);
      }
    }
  }
}

QuantMatrix quantize(WFormat f, const float* w, int64_t rows, int64_t K) {
  if (f == WFormat::F16) fail(ErrorKind::Request, "quantize: fp16 is not a quantized format");
  if (f == WFormat::I4 && K % kI4Group != 0)
    fail(ErrorKind::Unsupported, "int4 weights need every matrix width to be a multiple of 32, got " +
                                     std::to_string(K));
  QuantMatrix m;
  m.format = f;
  m.rows = rows;
  m.K = K;
  m.ld = quant_ld(f, K);
  if (f == WFormat::I8) quantize_i8(m, w);
  else quantize_i4(m, w);
  return m;
}

QuantMatrix i8_from_q8_0(const int8_t* q, const uint16_t* d, int64_t rows, int64_t K, const std::string& what) {
  if (rows < 1 || K < 1 || K % kI8Block != 0)
    fail(ErrorKind::ModelFormat, "Q8_0 tensor '" + what + "': shape (" + std::to_string(rows) + ", " +
                                     std::to_string(K) + ") is not whole blocks of 32");
  QuantMatrix m;
  m.format = WFormat::I8;
  m.rows = rows;
  m.K = K;
  m.ld = i8_ld(K);  // == K
  m.q.resize((size_t)(rows * K));
  for (size_t i = 0; i < m.q.size(); i++) m.q[i] = (uint8_t)((int)q[i] + 128);  // -128..127 -> 0..255
  m.sm.assign(d, d + rows * (K / kI8Block));
  return m;
}

void dequantize_row(const QuantMatrix& m, int64_t r, float* out) {
  if (m.format == WFormat::I8) {
    const int64_t blocks = m.ld / kI8Block;
    const uint8_t* q = &m.q[(size_t)(r * m.ld)];
    for (int64_t b = 0; b * kI8Block < m.K; b++) {
      const float d = half_to_float(m.sm[(size_t)(r * blocks + b)]);
      const int64_t n = std::min<int64_t>(kI8Block, m.K - b * kI8Block);
      for (int64_t i = 0; i < n; i++) out[b * kI8Block + i] = d * (float)((int)q[b * kI8Block + i] - 128);
    }
  } else if (m.format == WFormat::I4) {
    const int64_t groups = m.K / kI4Group;
    for (int64_t g = 0; g < groups; g++) {
      const float s = half_to_float(m.sm[(size_t)((r * groups + g) * 2)]);
      const float mn = half_to_float(m.sm[(size_t)((r * groups + g) * 2 + 1)]);
      uint32_t words[kI4Group / 8];
      std::memcpy(words, &m.q[(size_t)(r * m.ld + g * kI4Group / 2)], sizeof(words));
      float* o = out + g * kI4Group;
      for (int w = 0; w < kI4Group / 8; w++)
        for (int i = 0; i < 8; i++) o[w * 8 + i] = s * (float)((words[w] >> i4_nibble_pos(i)) & 0xF) + mn;
    }
  } else {
    fail(ErrorKind::Request, "dequantize: fp16 is not a quantized format");
  }
}

std::vector<float> dequantize(const QuantMatrix& m) {
  std::vector<float> w((size_t)(m.rows * m.K));
  if (m.format == WFormat::F16) return w;
  for (int64_t r = 0; r < m.rows; r++) dequantize_row(m, r, &w[(size_t)(r * m.K)]);
  return w;
}

void quantize_dequantize(WFormat f, float* w, int64_t rows, int64_t K) {
  if (f == WFormat::F16) {
    for (int64_t i = 0; i < rows * K; i++) w[i] = round_half(w[i]);
    return;
  }
  const std::vector<float> d = dequantize(quantize(f, w, rows, K));
  std::copy(d.begin(), d.end(), w);
}

void act8_round(float* x, int64_t K) {
  for (int64_t g = 0; g + 32 <= K; g += 32) {
    float v[32], amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(v[j] = round_half(x[g + j])));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) x[g + j] = d * std::round(v[j] * id);
  }
}

}  // namespace ti
