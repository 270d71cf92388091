// Vectorized reduction kernels. Loops are written so the compiler vectorizes them; on
// x86-64 each kernel is compiled for AVX-512, AVX2 and baseline SSE2 and the best one
// is chosen at load time (target_clones), so one build runs well on any x86 node.
// fp16 and bf16 are widened to float, combined and rounded back to nearest-even.
#include "reduce.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PCCL_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PCCL_MULTIVERSION
#endif

namespace pccl {
namespace {

struct bf16 { uint16_t bits; };

inline float widen(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 narrow_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16{static_cast<uint16_t>(u >> 16)};
}

#if defined(__FLT16_MAX__)
using f16 = _Float16;
inline float widen(f16 v) { return static_cast<float>(v); }
inline f16 narrow_f16(float f) { return static_cast<f16>(f); }
#else
#error "pccl needs a compiler with _Float16 (GCC >= 12 or Clang >= 15 on x86-64 / AArch64)"
#endif

struct SumOp { template <typename T> static T apply(T a, T b) { return a + b; } };
struct MaxOp { template <typename T> static T apply(T a, T b) { return a > b ? a : b; } };
struct MinOp { template <typename T> static T apply(T a, T b) { return a < b ? a : b; } };

template <typename T, typename O>
PCCL_MULTIVERSION void combine(T* __restrict dst, const T* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = O::apply(dst[i], src[i]);
}

template <typename O>
PCCL_MULTIVERSION void combine_bf16(bf16* __restrict dst, const bf16* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = narrow_bf16(O::apply(widen(dst[i]), widen(src[i])));
}

template <typename O>
PCCL_MULTIVERSION void combine_f16(f16* __restrict dst, const f16* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = narrow_f16(O::apply(widen(dst[i]), widen(src[i])));
}

template <typename O>
void dispatch_dtype(void* dst, const void* src, int64_t n, DType dtype) {
  switch (dtype) {
    case DType::F32: return combine<float, O>(static_cast<float*>(dst), static_cast<const float*>(src), n);
    case DType::F64: return combine<double, O>(static_cast<double*>(dst), static_cast<const double*>(src), n);
    case DType::I32: return combine<int32_t, O>(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n);
    case DType::I64: return combine<int64_t, O>(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n);
    case DType::F16: return combine_f16<O>(static_cast<f16*>(dst), static_cast<const f16*>(src), n);
    case DType::BF16: return combine_bf16<O>(static_cast<bf16*>(dst), static_cast<const bf16*>(src), n);
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

template <typename T>
PCCL_MULTIVERSION void scale_plain(T* __restrict buf, int64_t n, T factor) {
  for (int64_t i = 0; i < n; ++i) buf[i] *= factor;
}

PCCL_MULTIVERSION void scale_bf16(bf16* __restrict buf, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) buf[i] = narrow_bf16(widen(buf[i]) * factor);
}

PCCL_MULTIVERSION void scale_f16(f16* __restrict buf, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) buf[i] = narrow_f16(widen(buf[i]) * factor);
}

}  // namespace

void reduce_into(void* dst, const void* src, int64_t n, DType dtype, Op op) {
  switch (op) {
    case Op::Sum: case Op::Avg: return dispatch_dtype<SumOp>(dst, src, n, dtype);
    case Op::Max: return dispatch_dtype<MaxOp>(dst, src, n, dtype);
    case Op::Min: return dispatch_dtype<MinOp>(dst, src, n, dtype);
  }
  throw std::invalid_argument("unknown op code " + std::to_string(static_cast<int>(op)));
}

void scale(void* buf, int64_t n, DType dtype, double factor) {
  switch (dtype) {
    case DType::F32: return scale_plain<float>(static_cast<float*>(buf), n, static_cast<float>(factor));
    case DType::F64: return scale_plain<double>(static_cast<double*>(buf), n, factor);
    case DType::F16: return scale_f16(static_cast<f16*>(buf), n, static_cast<float>(factor));
    case DType::BF16: return scale_bf16(static_cast<bf16*>(buf), n, static_cast<float>(factor));
    default: throw std::invalid_argument("scaling (op avg) needs a floating-point dtype");
  }
}

}  // namespace pccl
