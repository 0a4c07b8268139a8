// cuda_options.cu — check_options: CudaOptions checked at load (cuda_options.h), before anything is allocated.
#include "cuda_options.h"

#include "../../cuda/attention.cuh"
#include "../../cuda/common.cuh"
#include "../core/engine_checks.h"
#include "../core/errors.h"

namespace ti {

void check_options(const CudaOptions& o, const ModelConfig& c) {
  if (o.attn_chunk < 8 || o.attn_chunk > 128) fail(ErrorKind::Request, "attn_chunk must be 8..128");
  const int P = o.kv_page_size;
  if (P < 64 || P > (1 << 20) || (P & (P - 1)))
    fail(ErrorKind::Request, "kv_page_size must be a power of two in 64..2^20, got " + std::to_string(P));
  if (P < o.attn_chunk)  // (a split-K block then reads at most two pages)
    fail(ErrorKind::Request, "kv_page_size " + std::to_string(P) + " must be >= attn_chunk " + std::to_string(o.attn_chunk));
  if (o.kv_pool_pages < 0)
    fail(ErrorKind::Request, "kv_pool_pages must be >= 0 (0: enough for max_seq_len), got " +
                                 std::to_string(o.kv_pool_pages));
  check_max_batch(o.max_batch);
  if (o.draft_pass != 0 && o.draft_pass != 1)
    fail(ErrorKind::Request, "draft_pass must be 0 (the prefill pass) or 1 (the batched step), got " +
                                 std::to_string(o.draft_pass));
  if (o.batch_gemv_f16_max < 0) fail(ErrorKind::Request, "batch_gemv_f16_max must be >= 0");
  if (o.batch_gemv_quant_max < 0) fail(ErrorKind::Request, "batch_gemv_quant_max must be >= 0");
  if (o.batch_mma_max < 0 || o.batch_mma_max > 64)
    fail(ErrorKind::Request, "batch_mma_max must be in 0..64, got " + std::to_string(o.batch_mma_max));
  if (o.batch_mma_f16_max < 0 || o.batch_mma_f16_max > 64)
    fail(ErrorKind::Request, "batch_mma_f16_max must be in 0..64, got " + std::to_string(o.batch_mma_f16_max));
  if (o.batch_mma_f16_qkvo_max < 0 || o.batch_mma_f16_qkvo_max > 64)
    fail(ErrorKind::Request,
         "batch_mma_f16_qkvo_max must be in 0..64, got " + std::to_string(o.batch_mma_f16_qkvo_max));
  if (o.batch_mma_f16_down_max < 0 || o.batch_mma_f16_down_max > 64)
    fail(ErrorKind::Request,
         "batch_mma_f16_down_max must be in 0..64, got " + std::to_string(o.batch_mma_f16_down_max));
  if (o.batch_down_k_slices < 0 || o.batch_down_k_slices > 8 ||
      (o.batch_down_k_slices > 1 && (o.batch_down_k_slices & (o.batch_down_k_slices - 1)) != 0))
    fail(ErrorKind::Request,
         "batch_down_k_slices must be 0, 1, 2, 4 or 8, got " + std::to_string(o.batch_down_k_slices));
  if (o.batch_mma_m_tiles < 0 || o.batch_mma_m_tiles > 2)
    fail(ErrorKind::Request, "batch_mma_m_tiles must be 0 (auto), 1 or 2, got " + std::to_string(o.batch_mma_m_tiles));
  {
    cuda::DecodeAttnParams a;  // (a clear error for a span the head dim cannot take)
    a.head_dim = (int)c.head_dim;
    a.rows_span = o.batch_attn_span;
    if (o.batch_attn_span != 0) cuda::attn_rows_span_of(a);
    a.rows_heads = o.batch_attn_heads;
    cuda::check_attn_rows_heads(a);
  }
  if (o.gemv_grid < -1 || o.gemv_grid > 2) fail(ErrorKind::Request, "gemv_grid must be -1 (tuned), 0, 1 or 2");
  if (o.act8 < -2 || o.act8 > 2)
    fail(ErrorKind::Request,
         "act8 must be -2 (int4 weights but down), -1 (int4 weights), 0 (off), 1 (tuned per role) or 2 (on)");
  if (!(o.gemv_resident_margin >= 0 && o.gemv_resident_margin <= 1))
    fail(ErrorKind::Request, "gemv_resident_margin must be in [0, 1]");
  for (const GemvPin& pin : o.gemv_pins) {
    check_pin(pin);
    if (pin.rows_per_warp == kGemvMmaOneRow && o.trace)
      fail(ErrorKind::Request,
           "gemv_pins: the tensor-core product (16) has no trace stamps: not with CudaOptions.trace");
  }
  if (o.persistent_timeout_ms < 1) fail(ErrorKind::Request, "persistent_timeout_ms must be >= 1");
  if (o.persistent_blocks_per_sm < 1 || o.persistent_blocks_per_sm > 4)
    fail(ErrorKind::Request, "persistent_blocks_per_sm must be 1 to 4");
  if (o.persistent_ring_slots < 2 || o.persistent_ring_slots > 8)
    fail(ErrorKind::Request, "persistent_ring_slots must be 2 to 8");
  if (o.persistent_ring_slot_kib < 1 || o.persistent_ring_slot_kib > 128)
    fail(ErrorKind::Request, "persistent_ring_slot_kib must be 1 to 128");
  if (o.decode_long_from < -1) fail(ErrorKind::Request, "decode_long_from must be -1 (tuned), 0 (off) or a context");
  if (o.early_trigger < -1 || o.early_trigger > 2)
    fail(ErrorKind::Request, "early_trigger must be -1 (timed), 0 (off), 1 (the GEMVs) or 2 (the GEMVs and the "
                             "attention), got " + std::to_string(o.early_trigger));
  if (o.smem_carveout < -2 || o.smem_carveout > 100)
    fail(ErrorKind::Request, "smem_carveout must be -2 (timed), -1 (the driver's choice) or a percent 0..100, got " +
                                 std::to_string(o.smem_carveout));
  if (o.smem_carveout >= 0 && !cuda::kLaunchCarveout)
    fail(ErrorKind::Request, "smem_carveout: this build's CUDA toolkit (before 12.5) cannot ask for a carveout");
#ifndef TI_TRACE
  if (o.trace)
    fail(ErrorKind::Request, "CudaOptions.trace: this build has no tracing (rebuild with CMAKE_ARGS=-DTINYINFER_TRACE=ON)");
#endif
}

}  // namespace ti
