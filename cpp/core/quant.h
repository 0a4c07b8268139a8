// quant.h — weight-only quantized formats: the reference packers and dequantizers (host), shared by the CPU
// engine (which computes with exactly the dequantized numbers), the GPU quantizer's tests and the GGUF import.
//
// Both formats quantize the fp16-rounded weight (what the fp16 engine computes with), row by row:
//   I8  per output channel, symmetric: s = max|w| / 127 (fp32), q = clamp(rint(w / s), -127, 127), w' = q s.
//       Stored as bytes u = q + 128 (so the kernel turns a byte into a float with one byte-permute into the
//       mantissa of 2^23 and one subtract), rows padded to 16 bytes with u = 128 (q = 0), and s per row (fp32).
//       1 byte per weight + 4 per row.
//   I4  groups of 32 along the row, asymmetric: s = fp16((max - min) / 15), m = fp16(min), q = clamp(rint((w - m)
//       / s), 0, 15), w' = s q + m. 4 bits per weight + (s, m) as two fp16 per group: 0.625 bytes per weight.
//       Why 32 and asymmetric: (1) GGUF's Q4_0 (scale, 32 weights) and Q4_1 (scale, min, 32 weights) map onto
//       it exactly (a Q4_1 model re-quantized this way loses nothing measurable); (2) on SmolLM2-135M, groups of
//       64 or symmetric groups of 32 cost +42-43% perplexity against +0% for this choice (docs/perf/QUANT-NOTES.md).
//       K must be a multiple of 32.
//       Nibble order inside each 32-bit word of 8 consecutive weights w0..w7: bit offsets 0,16,4,20,8,24,12,28,
//       so that (word >> 4j) & 0x000F000F holds w(2j) and w(2j+1) in the two 16-bit halves: with 0x6400 or-ed in,
//       that is the fp16 pair (1024 + w(2j), 1024 + w(2j+1)) — the kernel's magic-number dequantization.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ti {

enum class WFormat { F16, I8, I4 };
WFormat wformat_from_string(const std::string& s);  // "fp16" | "int8" | "int4"
std::string to_string(WFormat f);

constexpr int kI4Group = 32;
// Bit offset of weight i (0..7) inside its 32-bit word: 0, 16, 4, 20, 8, 24, 12, 28 (see the format note above).
// A constexpr function rather than a table, so host code and the kernels share it.
constexpr int i4_nibble_pos(int i) { return (i & 1) * 16 + (i >> 1) * 4; }
static_assert(i4_nibble_pos(0) == 0 && i4_nibble_pos(1) == 16 && i4_nibble_pos(6) == 12 && i4_nibble_pos(7) == 28,
              "int4 nibble order");
// Throws ti::Error(Unsupported) unless every matrix width of the model is a multiple of the int4 group.
void require_int4_widths(int64_t hidden, int64_t q_dim, int64_t intermediate);
// The LM head's format for a model in format f: int4 models keep an int8 head. Measured on SmolLM2-135M (whose
// GGUF head is Q8_0): an int4 head costs +7.6% perplexity, an int8 one -0.1% (docs/perf/QUANT-NOTES.md);
// llama.cpp's 4-bit mixes likewise keep the output matrix at 6-8 bits.
inline WFormat head_format(WFormat f) { return f == WFormat::I4 ? WFormat::I8 : f; }
inline int64_t i8_ld(int64_t K) { return (K + 15) / 16 * 16; }  // bytes per I8 row
inline int64_t i4_ld(int64_t K) { return K / 2; }                // bytes per I4 row (K % 32 == 0)
// Device bytes of one (rows, K) matrix in a format, scales included (F16: rows padded to 8 halves).
int64_t quant_bytes(WFormat f, int64_t rows, int64_t K);

struct QuantMatrix {
  WFormat format = WFormat::F16;
  int64_t rows = 0, K = 0, ld = 0;   // ld: bytes per row of q
  std::vector<uint8_t> q;            // (rows, ld)
  std::vector<float> scale;          // I8: (rows)
  std::vector<uint16_t> sm;          // I4: (rows, K / 32, 2) fp16 bits: scale, min
};

// w: (rows, K) fp32, rounded to fp16 first. Throws ti::Error(Unsupported) for I4 with K % 32 != 0.
QuantMatrix quantize(WFormat f, const float* w, int64_t rows, int64_t K);
// (rows, K) fp32: the numbers the quantized matrix stands for.
std::vector<float> dequantize(const QuantMatrix& m);
// In place: w := dequantize(quantize(w)) (F16: w := fp16(w)). The CPU engine's view of a quantized model.
void quantize_dequantize(WFormat f, float* w, int64_t rows, int64_t K);

}  // namespace ti
