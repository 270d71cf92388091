// Vectorized reduction kernels. Loops are written so the compiler vectorizes them; on
// x86-64 each kernel is compiled for AVX-512, AVX2 and baseline SSE2 and the best one
// is chosen at load time (target_clones), so one build runs well on any x86 node.
// fp16 and bf16 are widened to float, combined and rounded back to nearest-even.
#include "reduce.h"

#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PCCL_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PCCL_MULTIVERSION
#endif

#if !defined(__FLT16_MAX__)
#error "pccl needs a compiler with _Float16 (GCC >= 12 or Clang >= 15 on x86-64 / AArch64)"
#endif

namespace pccl {
namespace {

struct bf16 { uint16_t bits; };
using f16 = _Float16;

// How an element type is computed with: plain types as themselves, half types in float.
template <typename T>
struct Num {
  using Acc = T;
  static T load(T v) { return v; }
  static T store(T v) { return v; }
};

template <>
struct Num<f16> {
  using Acc = float;
  static float load(f16 v) { return static_cast<float>(v); }
  static f16 store(float f) { return static_cast<f16>(f); }
};

template <>
struct Num<bf16> {
  using Acc = float;
  static float load(bf16 v) {
    uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static bf16 store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return bf16{static_cast<uint16_t>(u >> 16)};
  }
};

struct SumOp { template <typename T> static T apply(T a, T b) { return a + b; } };
struct MaxOp { template <typename T> static T apply(T a, T b) { return a > b ? a : b; } };
struct MinOp { template <typename T> static T apply(T a, T b) { return a < b ? a : b; } };

// dst may alias a (element-wise, so that is safe); the compiler versions the loop for it.
template <typename T, typename O>
PCCL_MULTIVERSION void combine(T* dst, const T* a, const T* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Num<T>::store(O::apply(Num<T>::load(a[i]), Num<T>::load(b[i])));
}

template <typename T>
PCCL_MULTIVERSION void multiply(T* __restrict buf, int64_t n, typename Num<T>::Acc factor) {
  for (int64_t i = 0; i < n; ++i) buf[i] = Num<T>::store(Num<T>::load(buf[i]) * factor);
}

template <typename T, typename O>
void run(void* dst, const void* a, const void* b, int64_t n) {
  combine<T, O>(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n);
}

template <typename O>
void by_dtype(void* dst, const void* a, const void* b, int64_t n, DType dtype) {
  switch (dtype) {
    case DType::F32: return run<float, O>(dst, a, b, n);
    case DType::F64: return run<double, O>(dst, a, b, n);
    case DType::I32: return run<int32_t, O>(dst, a, b, n);
    case DType::I64: return run<int64_t, O>(dst, a, b, n);
    case DType::F16: return run<f16, O>(dst, a, b, n);
    case DType::BF16: return run<bf16, O>(dst, a, b, n);
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

}  // namespace

void reduce(void* dst, const void* a, const void* b, int64_t n, DType dtype, Op op) {
  switch (op) {
    case Op::Sum: case Op::Avg: return by_dtype<SumOp>(dst, a, b, n, dtype);
    case Op::Max: return by_dtype<MaxOp>(dst, a, b, n, dtype);
    case Op::Min: return by_dtype<MinOp>(dst, a, b, n, dtype);
  }
  throw std::invalid_argument("unknown op code " + std::to_string(static_cast<int>(op)));
}

void scale(void* buf, int64_t n, DType dtype, double factor) {
  switch (dtype) {
    case DType::F32: return multiply(static_cast<float*>(buf), n, static_cast<float>(factor));
    case DType::F64: return multiply(static_cast<double*>(buf), n, factor);
    case DType::F16: return multiply(static_cast<f16*>(buf), n, static_cast<float>(factor));
    case DType::BF16: return multiply(static_cast<bf16*>(buf), n, static_cast<float>(factor));
    default: throw std::invalid_argument("scaling (op avg) needs a floating-point dtype");
  }
}

}  // namespace pccl
