#include "rope.h"

#include <cmath>

namespace ti {

std::vector<float> rope_inv_freq(const ModelConfig& c) {
  const int64_t half = c.head_dim / 2;
  std::vector<float> inv(half);
  for (int64_t i = 0; i < half; i++) {
    // transformers computes this in fp32: keep the same rounding point.
    float expo = (float)(2 * i) / (float)c.head_dim;
    inv[i] = (float)(1.0 / std::pow(c.rope_theta, (double)expo));
  }
  if (c.rope_scaling == RopeScaling::Linear) {
    for (float& f : inv) f = (float)(f / c.rope_factor);
  } else if (c.rope_scaling == RopeScaling::Llama3) {
    // Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    const double old_ctx = (double)c.rope_original_max_pos;
    const double low_wavelen = old_ctx / c.rope_low_freq_factor, high_wavelen = old_ctx / c.rope_high_freq_factor;
    for (float& f : inv) {
      const double wavelen = 2.0 * M_PI / f;
      if (wavelen < high_wavelen) continue;
      if (wavelen > low_wavelen) {
        f = (float)(f / c.rope_factor);
      } else {
        const double smooth = (old_ctx / wavelen - c.rope_low_freq_factor) /
                              (c.rope_high_freq_factor - c.rope_low_freq_factor);
        f = (float)((1.0 - smooth) * f / c.rope_factor + smooth * f);
      }
    }
  }
  return inv;
}

RopeTable rope_table(const ModelConfig& c, int64_t max_pos) {
  RopeTable t;
  t.half = c.head_dim / 2;
  std::vector<float> inv = rope_inv_freq(c);
  t.cos.resize((size_t)(max_pos * t.half));
  t.sin.resize((size_t)(max_pos * t.half));
  for (int64_t p = 0; p < max_pos; p++)
    for (int64_t i = 0; i < t.half; i++) {
      const float angle = (float)p * inv[i];  // fp32 product, as transformers does
      t.cos[p * t.half + i] = (float)std::cos((double)angle);
      t.sin[p * t.half + i] = (float)std::sin((double)angle);
    }
  return t;
}

void rope_apply(float* x, int64_t n_heads, int64_t head_dim, const RopeTable& t, int64_t pos) {
  const int64_t half = head_dim / 2;
  const float* cs = &t.cos[pos * half];
  const float* sn = &t.sin[pos * half];
  for (int64_t h = 0; h < n_heads; h++) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < half; i++) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * cs[i] - x2 * sn[i];
      v[i + half] = x2 * cs[i] + x1 * sn[i];
    }
  }
}

}  // namespace ti
