// Element types and reduction operators shared by the executor, the kernels and the
// bindings. The numeric values are part of the Python interface (pccl/core/dtypes.py).
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace pccl {

enum class DType : int { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I32 = 4, I64 = 5 };
enum class Op : int { Sum = 0, Avg = 1, Max = 2, Min = 3 };

inline size_t elem_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::F64: case DType::I64: return 8;
    case DType::F16: case DType::BF16: return 2;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(static_cast<int>(t)));
}

inline bool is_float(DType t) { return t != DType::I32 && t != DType::I64; }

}  // namespace pccl
