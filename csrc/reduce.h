// CPU reduction kernels: dst[i] = op(dst[i], src[i]) and in-place scaling.
#pragma once
#include <cstdint>

#include "types.h"

namespace pccl {

// Element-wise dst = op(a, b) over n elements; dst may be a. Avg reduces as Sum (the
// caller scales once at the end).
void reduce(void* dst, const void* a, const void* b, int64_t n, DType dtype, Op op);

// dst = op(dst, src).
inline void reduce_into(void* dst, const void* src, int64_t n, DType dtype, Op op) {
  reduce(dst, dst, src, n, dtype, op);
}

// buf *= factor over n elements (floating-point dtypes only).
void scale(void* buf, int64_t n, DType dtype, double factor);

}  // namespace pccl
