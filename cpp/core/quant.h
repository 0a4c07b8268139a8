// quant.h — weight-only quantized formats: the reference packers and dequantizers (host), shared by the CPU
// engine (which computes with exactly the dequantized numbers), the GPU quantizer's tests and the GGUF import.
//
// Both formats work in blocks of 32 consecutive weights of a row, with fp16 numbers per block (the layouts of
// GGUF's Q8_0 and Q4_0 / Q4_1, so those tensors import block for block with no second rounding), and quantize
// the fp16-rounded weight (what the fp16 engine computes with):
//   I8  symmetric, llama.cpp's quantize_row_q8_0 operation for operation: d = amax / 127 (fp32), id = d ? 1 / d
//       : 0, q = roundf(w id) (half away from zero; |q| <= 127), stored d = fp16(d); w' = float(fp16 d) q. An
//       imported Q8_0 block may hold q = -128: the whole int8 range is representable and dequantized exactly.
//       q stored as bytes u = q + 128 (so the kernel turns a byte into a float with one byte-permute into the
//       mantissa of 2^23 and one subtract), rows padded to a multiple of 32 bytes with u = 128 (q = 0), so any K
//       works (a partial last block quantizes as if padded with zeros); d as (rows, ld / 32) fp16 in an array
//       of its own (16-byte aligned weight rows for the GEMV). 1.0625 bytes per weight.
//   I4  asymmetric: s = fp16((max - min) / 15), m = fp16(min), q = clamp(rint((w - m) / s), 0, 15), w' = s q + m.
//       4 bits per weight + (s, m) as two fp16 per group: 0.625 bytes per weight.
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

// I4A8 and I8A8 are no stored formats: the GEMV kernels' names for I4 / I8 weights met by an input quantized to
// int8 (cuda/gemv_dot.cuh).
enum class WFormat { F16, I8, I4, I4A8, I8A8 };
WFormat wformat_from_string(const std::string& s);  // "fp16" | "int8" | "int4"
std::string to_string(WFormat f);

constexpr int kI4Group = 32;  // weights per I4 group
constexpr int kI8Block = 32;  // weights per I8 block (GGUF's QK8_0)
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
inline int64_t i8_ld(int64_t K) { return (K + kI8Block - 1) / kI8Block * kI8Block; }  // bytes per I8 row
inline int64_t i4_ld(int64_t K) { return K / 2; }                                       // bytes per I4 row
// Bytes per row of q, and fp16 numbers per row of scales (I8: d per block; I4: (scale, min) per group).
inline int64_t quant_ld(WFormat f, int64_t K) { return f == WFormat::I8 ? i8_ld(K) : i4_ld(K); }
inline int64_t scale_halves(WFormat f, int64_t K) {
  return f == WFormat::I8 ? i8_ld(K) / kI8Block : K / kI4Group * 2;
}
// Device bytes of one (rows, K) matrix in a format, scales included (F16: rows padded to 8 halves).
int64_t quant_bytes(WFormat f, int64_t rows, int64_t K);

struct QuantMatrix {
  WFormat format = WFormat::F16;
  int64_t rows = 0, K = 0, ld = 0;   // ld: bytes per row of q
  std::vector<uint8_t> q;            // (rows, ld)
  std::vector<uint16_t> sm;          // (rows, scale_halves(format, K)) fp16 bits. I8: d; I4: (scale, min) pairs
};

// w: (rows, K) fp32, rounded to fp16 first. Throws ti::Error(Unsupported) for I4 with K % 32 != 0.
QuantMatrix quantize(WFormat f, const float* w, int64_t rows, int64_t K);
// GGUF Q8_0's numbers in our I8 layout, exactly: q (rows, K) signed, d (rows, K / 32) fp16 bits; K % 32 == 0
// (else ti::Error(ModelFormat) naming `what`).
QuantMatrix i8_from_q8_0(const int8_t* q, const uint16_t* d, int64_t rows, int64_t K, const std::string& what);
// (rows, K) fp32: the numbers the quantized matrix stands for.
std::vector<float> dequantize(const QuantMatrix& m);
// Row r of dequantize(m) into out[0..K): the CPU engine widens one row at a time inside its dot products, so
// it computes with these numbers while the matrix stays in its blocks. dequantize() is built on it.
void dequantize_row(const QuantMatrix& m, int64_t r, float* out);
// In place: w := dequantize(quantize(w)) (F16: w := fp16(w)). The CPU engine's view of a quantized model.
void quantize_dequantize(WFormat f, float* w, int64_t rows, int64_t K);

// The int8 input of a quantized product (CudaOptions::act8; the GPU's rule is cuda/act8.cuh), in place on x[0..K):
// per group of 32 of the fp16-rounded values (what the GPU stages), d = amax / 127 and xq = round(x * (1 / d)) half
// away from zero; x := d xq in fp32 (the decode GEMV's dp4a arithmetic). A partial last group is left as it is
// (the GPU takes int8 inputs only where K % 32 == 0).
void act8_round(float* x, int64_t K);

}  // namespace ti
