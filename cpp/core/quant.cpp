#include "quant.h"

#include <algorithm>
#include <cmath>

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
  switch (f) {
    case WFormat::F16: return rows * ((K + 7) / 8 * 8) * 2;
    case WFormat::I8: return rows * i8_ld(K) + rows * 4;
    case WFormat::I4: return rows * i4_ld(K) + rows * (K / kI4Group) * 4;
  }
  return 0;
}

void require_int4_widths(int64_t hidden, int64_t q_dim, int64_t intermediate) {
  for (int64_t K : {hidden, q_dim, intermediate})
    if (K % kI4Group != 0)
      fail(ErrorKind::Unsupported, "int4 weights need hidden, n_heads * head_dim and intermediate to be "
                                   "multiples of 32 (this model has " + std::to_string(hidden) + ", " +
                                   std::to_string(q_dim) + ", " + std::to_string(intermediate) + ")");
}

static float round_half(float x) { return half_to_float(float_to_half(x)); }

QuantMatrix quantize(WFormat f, const float* w, int64_t rows, int64_t K) {
  QuantMatrix m;
  m.format = f;
  m.rows = rows;
  m.K = K;
  std::vector<float> row((size_t)K);
  if (f == WFormat::I8) {
    m.ld = i8_ld(K);
    m.q.assign((size_t)(rows * m.ld), 128);
    m.scale.resize((size_t)rows);
    for (int64_t r = 0; r < rows; r++) {
      float amax = 0.0f;
      for (int64_t k = 0; k < K; k++) {
        row[(size_t)k] = round_half(w[r * K + k]);
        amax = std::max(amax, std::fabs(row[(size_t)k]));
      }
      const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
      m.scale[(size_t)r] = s;
      for (int64_t k = 0; k < K; k++) {
        const float q = std::min(127.0f, std::max(-127.0f, std::rint(row[(size_t)k] / s)));
        m.q[(size_t)(r * m.ld + k)] = (uint8_t)((int)q + 128);
      }
    }
    return m;
  }
  if (f == WFormat::I4) {
    if (K % kI4Group != 0)
      fail(ErrorKind::Unsupported, "int4 weights need every matrix width to be a multiple of 32, got " +
                                       std::to_string(K));
    m.ld = i4_ld(K);
    m.q.assign((size_t)(rows * m.ld), 0);
    m.sm.resize((size_t)(rows * (K / kI4Group) * 2));
    for (int64_t r = 0; r < rows; r++) {
      for (int64_t g = 0; g < K / kI4Group; g++) {
        float lo = INFINITY, hi = -INFINITY, v[kI4Group];
        for (int i = 0; i < kI4Group; i++) {
          v[i] = round_half(w[r * K + g * kI4Group + i]);
          lo = std::min(lo, v[i]);
          hi = std::max(hi, v[i]);
        }
        const uint16_t sh = float_to_half((hi - lo) / 15.0f), mh = float_to_half(lo);
        const float s = half_to_float(sh), mn = half_to_float(mh);
        m.sm[(size_t)((r * (K / kI4Group) + g) * 2)] = sh;
        m.sm[(size_t)((r * (K / kI4Group) + g) * 2 + 1)] = mh;
        uint32_t* words = reinterpret_cast<uint32_t*>(&m.q[(size_t)(r * m.ld + g * kI4Group / 2)]);
        for (int i = 0; i < kI4Group; i++) {
          const float q = s > 0.0f ? std::min(15.0f, std::max(0.0f, std::rint((v[i] - mn) / s))) : 0.0f;
          words[i / 8] |= (uint32_t)q << i4_nibble_pos(i % 8);
        }
      }
    }
    return m;
  }
  fail(ErrorKind::Request, "quantize: fp16 is not a quantized format");
}

std::vector<float> dequantize(const QuantMatrix& m) {
  std::vector<float> w((size_t)(m.rows * m.K));
  if (m.format == WFormat::I8) {
    for (int64_t r = 0; r < m.rows; r++)
      for (int64_t k = 0; k < m.K; k++)
        w[(size_t)(r * m.K + k)] = (float)((int)m.q[(size_t)(r * m.ld + k)] - 128) * m.scale[(size_t)r];
  } else if (m.format == WFormat::I4) {
    const int64_t groups = m.K / kI4Group;
    for (int64_t r = 0; r < m.rows; r++)
      for (int64_t g = 0; g < groups; g++) {
        const float s = half_to_float(m.sm[(size_t)((r * groups + g) * 2)]);
        const float mn = half_to_float(m.sm[(size_t)((r * groups + g) * 2 + 1)]);
        const uint32_t* words = reinterpret_cast<const uint32_t*>(&m.q[(size_t)(r * m.ld + g * kI4Group / 2)]);
        for (int i = 0; i < kI4Group; i++) {
          const uint32_t q = (words[i / 8] >> i4_nibble_pos(i % 8)) & 0xF;
          w[(size_t)(r * m.K + g * kI4Group + i)] = s * (float)q + mn;
        }
      }
  }
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

}  // namespace ti
