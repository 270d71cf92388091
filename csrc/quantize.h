// Block-wise absmax int8 quantization (ZeRO++'s weight and gradient quantization): each
// group of kGroup consecutive values keeps one fp32 scale, absmax / 127, and each value
// round(x / scale) in int8. Encoded layout of n values: ceil(n / kGroup) fp32 scales, then
// n int8 values. |decoded - x| <= scale / 2 = absmax(group) / 254 per value (plus float
// rounding). A group holding NaN or Inf gets a NaN scale: it decodes to NaN, so
// non-finite values stay visible instead of turning into garbage.
#pragma once
#include <cstdint>

#include "types.h"

namespace pccl {

constexpr int64_t kGroup = 128;

inline int64_t int8_encoded_bytes(int64_t n) { return 4 * ((n + kGroup - 1) / kGroup) + n; }

// src: n values of dtype (float32, float16 or bfloat16) -> dst: int8_encoded_bytes(n) bytes.
void int8_encode(void* dst, const void* src, int64_t n, DType dtype);

// src: an encoding of n values -> dst (n values of dtype); op None (-1) overwrites, else
// dst = op(dst, decoded).
void int8_decode(void* dst, const void* src, int64_t n, DType dtype, int op);

}  // namespace pccl
