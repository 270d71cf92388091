// Block-wise absmax int8 quantization (see quantize.h). Each group is two passes over at
// most kGroup values (absmax, then scale and round), written so the compiler vectorizes
// them; decoding multiplies back and, for decode-and-reduce, combines into dst.
#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "extrema.h"
#include "numeric.h"

namespace pccl {
namespace {

using num::bf16;
using num::f16;
using num::Num;

// Two plain loops over one group, written to vectorize. The first finds the largest
// magnitude as the largest bit pattern of |x| (an integer max: non-negative floats order as
// their bits), which also tells NaN (above Inf's pattern) and Inf (equal to it) apart from
// finite values. The second multiplies by 1 / scale, clamps, rounds to nearest even.
template <typename T>
PCCL_MULTIVERSION void encode_group(int8_t* __restrict q, char* scale_out, const T* __restrict x, int64_t len) {
  uint32_t top = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t bits = num::as_bits(Num<T>::load(x[i])) & 0x7fffffffu;
    top = bits > top ? bits : top;
  }
  const float scale = top >= 0x7f800000u ? NAN : num::as_float(top) / 127.0f;
  std::memcpy(scale_out, &scale, 4);
  if (!(scale >= 1e-36f)) {   // zero, NaN, or subnormal values (1 / scale would overflow): rare
    for (int64_t i = 0; i < len; ++i)
      // clamped as below: x / scale can round past 127 where the scale itself is subnormal
      q[i] = scale > 0.0f ? static_cast<int8_t>(std::fmax(-127.0f, std::fmin(127.0f, std::rint(Num<T>::load(x[i]) /
                                                                                                scale)))) : 0;
    return;
  }
  // Adding and subtracting 1.5 * 2^23 rounds to nearest even (|values| <= 127 here) in two
  // vector additions, where rint would stop the loop from vectorizing. The clamp is two
  // comparisons, not std::fmax/fmin, whose NaN rule kept GCC 12 from vectorizing the loop
  // (0.85 GB/s a core, against 6.9 vectorized; the values here are finite, where both clamp alike).
  const float inverse = 1.0f / scale, magic = 12582912.0f;
  for (int64_t i = 0; i < len; ++i) {
    float v = Num<T>::load(x[i]) * inverse;
    v = v < -127.0f ? -127.0f : v;
    v = v > 127.0f ? 127.0f : v;
    q[i] = static_cast<int8_t>(static_cast<int32_t>((v + magic) - magic));
  }
}

template <typename T>
void encode(int8_t* q, char* scales, const T* x, int64_t n) {
  for (int64_t g = 0; g * kGroup < n; ++g) {
    const int64_t start = g * kGroup;
    encode_group(q + start, scales + 4 * g, x + start, std::min(kGroup, n - start));
  }
}

template <typename T>
void decode(T* x, const int8_t* q, const char* scales, int64_t n, int op) {
  for (int64_t g = 0; g * kGroup < n; ++g) {
    const int64_t start = g * kGroup, len = std::min(kGroup, n - start);
    float scale;
    std::memcpy(&scale, scales + 4 * g, 4);
    for (int64_t i = 0; i < len; ++i) {
      // the decoded value in T, whether stored or reduced: both partners of an exchange
      // then combine the same two T values (store(a) + v would not commute with the
      // partner's store(v) + a in fp16 and bf16, and the ranks' results would differ)
      const float v = Num<T>::load(Num<T>::store(static_cast<float>(q[start + i]) * scale));
      T& out = x[start + i];
      if (op < 0) {
        out = Num<T>::store(v);
      } else if (op == static_cast<int>(Op::Max)) {
        out = Num<T>::store(extrema::larger(Num<T>::load(out), v));
      } else if (op == static_cast<int>(Op::Min)) {
        out = Num<T>::store(extrema::smaller(Num<T>::load(out), v));
      } else {
        out = Num<T>::store(Num<T>::load(out) + v);
      }
    }
  }
}

template <typename F>
void by_dtype(DType dtype, F f) {
  switch (dtype) {
    case DType::F32: return f(static_cast<float*>(nullptr));
    case DType::F16: return f(static_cast<f16*>(nullptr));
    case DType::BF16: return f(static_cast<bf16*>(nullptr));
    default:
      throw std::invalid_argument("int8 quantization takes float32, float16 or bfloat16 values, got dtype code " +
                                  std::to_string(static_cast<int>(dtype)));
  }
}

}  // namespace

void int8_encode(void* dst, const void* src, int64_t n, DType dtype) {
  auto* bytes = static_cast<char*>(dst);
  char* scales = bytes;   // not float*: an encoding packed after another may start at any byte
  auto* q = reinterpret_cast<int8_t*>(bytes + 4 * ((n + kGroup - 1) / kGroup));
  by_dtype(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    encode(q, scales, static_cast<const T*>(src), n);
  });
}

void int8_decode(void* dst, const void* src, int64_t n, DType dtype, int op) {
  const auto* bytes = static_cast<const char*>(src);
  const char* scales = bytes;
  const auto* q = reinterpret_cast<const int8_t*>(bytes + 4 * ((n + kGroup - 1) / kGroup));
  by_dtype(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    decode(static_cast<T*>(dst), q, scales, n, op);
  });
}

}  // namespace pccl
