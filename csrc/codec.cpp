// Codec dispatch, and the casts: fp32 values carried as bf16 or fp16 (round to nearest even,
// numeric.h's conversions), widened back on decode and combined with the op.
#include "codec.h"

#include <stdexcept>
#include <string>

#include "extrema.h"
#include "numeric.h"
#include "quantize.h"

namespace pccl {
namespace {

template <typename H>
PCCL_MULTIVERSION void narrow(H* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = num::Num<H>::store(src[i]);
}

template <typename H>
PCCL_MULTIVERSION void widen(float* __restrict dst, const H* __restrict src, int64_t n, int op) {
  if (op < 0) {
    for (int64_t i = 0; i < n; ++i) dst[i] = num::Num<H>::load(src[i]);
  } else if (op == static_cast<int>(Op::Max)) {
    for (int64_t i = 0; i < n; ++i) dst[i] = extrema::larger(dst[i], num::Num<H>::load(src[i]));
  } else if (op == static_cast<int>(Op::Min)) {
    for (int64_t i = 0; i < n; ++i) dst[i] = extrema::smaller(dst[i], num::Num<H>::load(src[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] += num::Num<H>::load(src[i]);
  }
}

void check_cast(DType dtype) {
  if (dtype != DType::F32)
    throw std::invalid_argument("the bf16 and fp16 codecs take float32 values, got dtype code " +
                                std::to_string(static_cast<int>(dtype)));
}

}  // namespace

Codec::Codec(int code) : kind(static_cast<CodecKind>(code)) {
  if (code < 0 || code > 2) throw std::invalid_argument("unknown native codec code " + std::to_string(code));
}

int64_t Codec::bytes(int64_t n) const { return kind == CodecKind::Int8 ? int8_encoded_bytes(n) : 2 * n; }

void Codec::encode(void* dst, const void* src, int64_t n, DType dtype) const {
  if (kind == CodecKind::Int8) return int8_encode(dst, src, n, dtype);
  check_cast(dtype);
  const auto* x = static_cast<const float*>(src);
  if (kind == CodecKind::Bf16) return narrow(static_cast<num::bf16*>(dst), x, n);
  narrow(static_cast<num::f16*>(dst), x, n);
}

void Codec::decode(void* dst, const void* src, int64_t n, DType dtype, int op) const {
  if (kind == CodecKind::Int8) return int8_decode(dst, src, n, dtype, op);
  check_cast(dtype);
  auto* x = static_cast<float*>(dst);
  if (kind == CodecKind::Bf16) return widen(x, static_cast<const num::bf16*>(src), n, op);
  widen(x, static_cast<const num::f16*>(src), n, op);
}

}  // namespace pccl
