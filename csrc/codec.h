// The codecs the C++ executor runs itself (pccl.compression.codecs, native=True): int8
// (quantize.h) and the fp32 -> bf16 / fp16 casts. Every codec is fixed-rate: the encoding
// of n values is bytes(n) long, so both sides of a message know its size from the schedule.
#pragma once
#include <cstdint>

#include "types.h"

namespace pccl {

// The numeric values are part of the Python interface (Codec.native).
enum class CodecKind : int { Int8 = 0, Bf16 = 1, Fp16 = 2 };

struct Codec {
  CodecKind kind;

  explicit Codec(int code);  // throws std::invalid_argument for an unknown code
  int64_t bytes(int64_t n) const;
  // src: n values of dtype -> dst: bytes(n) bytes. Casts take float32 values only.
  void encode(void* dst, const void* src, int64_t n, DType dtype) const;
  // An encoding of n values -> dst: op < 0 overwrites, else dst = op(dst, decoded).
  void decode(void* dst, const void* src, int64_t n, DType dtype, int op) const;
};

}  // namespace pccl
