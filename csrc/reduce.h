// CPU reduction kernels: dst[i] = op(dst[i], src[i]) and in-place scaling.
#pragma once
#include <cstdint>

#include "types.h"

namespace pccl {

// Element-wise dst = op(dst, src) over n elements. Avg reduces as Sum (the caller scales).
void reduce_into(void* dst, const void* src, int64_t n, DType dtype, Op op);

// buf *= factor over n elements (floating-point dtypes only).
void scale(void* buf, int64_t n, DType dtype, double factor);

}  // namespace pccl
