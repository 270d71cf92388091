// CPU reduction kernels: dst[i] = op(dst[i], src[i]) and in-place division (op avg).
#pragma once
#include <cstdint>

#include "types.h"

namespace pccl {

// Element-wise dst = op(a, b) over n elements; dst may be a. Avg reduces as Sum (the
// caller divides once at the end).
void reduce(void* dst, const void* a, const void* b, int64_t n, DType dtype, Op op);

// dst = op(dst, src).
inline void reduce_into(void* dst, const void* src, int64_t n, DType dtype, Op op) {
  reduce(dst, dst, src, n, dtype, op);
}

// buf /= divisor over n elements, a true division (floating-point dtypes only): op avg is
// a sum, then this division by the rank count, exactly as torch divides (half types in float,
// rounded once).
void divide(void* buf, int64_t n, DType dtype, int64_t divisor);

}  // namespace pccl
