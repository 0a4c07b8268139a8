// row_dot.h — products straight from the stored formats, on CPUs with AVX2 (+ F16C); a widened row with eight
// inputs at once (row_dots8, for the formats row_dots does not take); the attention's weighted values.
//
// Widening a matrix row into a buffer first and then calling dot() costs a second pass; here the row is widened 8
// weights at a time in registers and multiplied in the same loop, for up to four inputs at once. The numbers are
// dot()'s exactly: 8 partial sums (one per lane, lane j taking weights 8i + j in order), the same weight value as
// dequantize_row() / the fp16 table (mul then add, never fused), and the same final reduction. Returns false
// where it does not apply (no AVX2, a format or width it does not take); the caller then widens the row and
// calls dot().
#pragma once
#include <cstdint>

#include "../core/weights.h"

namespace ti {

// y[t * ldy + r - r0] = x_t . W[r] for r in [r0, r1) and the n inputs x_t = x + t * W.cols(), or false without
// touching y. A row's weights are unpacked once for up to four inputs.
bool row_dots(const HostTensor& W, const float* x, int64_t n, float* y, int64_t ldy, int64_t r0, int64_t r1);

// out[t] = dot(x + t * K, w, K) for t = 0..7: one widened fp32 row with eight inputs (a prefill's products), dot()'s
// numbers; eight independent chains of adds, each weight loaded once for the eight. False (nothing written)
// without AVX2 or where K is not a multiple of 8.
bool row_dots8(const float* w, const float* x, int64_t K, float out[8]);

// out[i] += w[r] * v[r * hd + i] for r = 0..rows-1 in order, each i its own chain (a rounded product, then a
// rounded add: the plain loop's numbers); the attention's weighted values, one cache page's rows at a time, with
// out held in registers across the rows. False (nothing written) without AVX2 or where hd is not a multiple of 8.
bool add_weighted_rows(float* out, const float* v, const float* w, int64_t rows, int64_t hd);

}  // namespace ti
