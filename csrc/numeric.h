// Half-precision types and how kernels compute with them: fp16 and bf16 are widened to
// float, combined, and rounded back to nearest-even. The conversions are integer and float
// arithmetic with selects instead of branches, so loops over them vectorize (GCC 12 turns
// _Float16 conversions into one scalar instruction or a library call per element).
#pragma once
#include <cstdint>
#include <cstring>

// Kernels compiled for AVX-512, AVX2 and baseline SSE2, the best chosen at load time, so
// one build runs well on any x86 node.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PCCL_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PCCL_MULTIVERSION
#endif

namespace pccl {
namespace num {

struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

inline float as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t as_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// How an element type is computed with: plain types as themselves, half types in float.
template <typename T>
struct Num {
  using Acc = T;
  static T load(T v) { return v; }
  static T store(T v) { return v; }
};

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
template <>
struct Num<f16> {
  using Acc = float;
  static float load(f16 v) {
    const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
    const uint32_t exponent = (v.bits >> 10) & 0x1fu, mantissa = v.bits & 0x3ffu;
    const uint32_t normal = ((exponent + (127 - 15)) << 23) | (mantissa << 13);
    const uint32_t special = 0x7f800000u | (mantissa << 13);                // inf, NaN
    const uint32_t small = as_bits(static_cast<float>(mantissa) * 0x1p-24f);  // zero, subnormal: exact
    return as_float(sign | (exponent == 0x1f ? special : exponent == 0 ? small : normal));
  }
  static f16 store(float f) {
    const uint32_t u = as_bits(f) & 0x7fffffffu;
    const uint32_t sign = (as_bits(f) >> 16) & 0x8000u;
    // Normal halves: rebias the exponent, round the 13 dropped bits to nearest even (a carry
    // into the exponent is the right result).
    const uint32_t normal = (u - ((127u - 15u) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
    // Below 2^-14: adding 0.5 lines the value up on half's subnormal step (2^-24) and the
    // float addition rounds it to nearest even; what remains above 0.5 is the result.
    const uint32_t small = as_bits(as_float(u) + 0.5f) - as_bits(0.5f);
    const uint32_t big = u > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN stays NaN; >= 65520 is inf
    const uint32_t h = u >= 0x477ff000u ? big : u < 0x38800000u ? small : normal;
    return f16{static_cast<uint16_t>(sign | h)};
  }
};

template <>
struct Num<bf16> {
  using Acc = float;
  static float load(bf16 v) { return as_float(static_cast<uint32_t>(v.bits) << 16); }
  static bf16 store(float f) {
    const uint32_t u = as_bits(f);
    const uint32_t nan = (u >> 16) | 0x40u;                  // quiet NaN
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // to nearest even
    return bf16{static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded)};
  }
};

}  // namespace num
}  // namespace pccl
