// Vectorized reduction kernels. Loops are written so the compiler vectorizes them; on
// x86-64 each kernel is compiled for AVX-512, AVX2 and baseline SSE2 and the best one
// is chosen at load time (target_clones), so one build runs well on any x86 node.
// fp16 and bf16 are widened to float, combined and rounded back to nearest-even with the
// branch-free conversions of numeric.h (GCC 12 turns _Float16 conversions into one scalar
// instruction or a library call per element: 5-30x slower than memcpy). On x86 CPUs with
// AVX2 both run in 256-bit registers, fp16 converted by F16C.
#include "reduce.h"

#include <cstring>
#include <type_traits>

#include "extrema.h"
#include "numeric.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define PCCL_AVX2 1
#endif


namespace pccl {
namespace {

using num::as_bits;
using num::as_float;
using num::bf16;
using num::f16;
using num::Num;

struct SumOp { template <typename T> static T apply(T a, T b) { return a + b; } };
struct MaxOp { template <typename T> static T apply(T a, T b) { return extrema::larger(a, b); } };
struct MinOp { template <typename T> static T apply(T a, T b) { return extrema::smaller(a, b); } };

// dst may alias a (element-wise, so that is safe); the compiler versions the loop for it.
template <typename T, typename O>
PCCL_MULTIVERSION void combine(T* dst, const T* a, const T* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Num<T>::store(O::apply(Num<T>::load(a[i]), Num<T>::load(b[i])));
}

// A true division, not a multiplication by 1/divisor: x * float(1/3) and x / 3 differ in
// about a third of all values, and torch, gloo and the Python executors divide.
template <typename T>
PCCL_MULTIVERSION void divide(T* __restrict buf, int64_t n, typename Num<T>::Acc divisor) {
  for (int64_t i = 0; i < n; ++i) buf[i] = Num<T>::store(Num<T>::load(buf[i]) / divisor);
}

#ifdef PCCL_AVX2
// Half types on x86 with AVX2, widened to floats in registers. fp16 converts with F16C, 8
// values per step. bf16 needs no shuffles: 16 values in 32-bit lanes are 8 floats in the
// high halves (odd values, low bits masked off) and 8 in the low halves (even values,
// shifted up), computed separately and rounded to nearest even like Num<bf16>::store.
#define PCCL_AVX2_FN __attribute__((target("avx2,f16c")))

// MAXPS and MINPS return the second operand unless the first compares greater (less):
// extrema.h's rule once ties take the AND (OR) of the bits and a NaN in the first is put back.
template <typename O> struct Combine8 {
  PCCL_AVX2_FN __m256 operator()(__m256 a, __m256 b) const {
    if constexpr (std::is_same_v<O, SumOp>) return _mm256_add_ps(a, b);
    constexpr bool larger = std::is_same_v<O, MaxOp>;
    const __m256 m = larger ? _mm256_max_ps(a, b) : _mm256_min_ps(a, b);
    const __m256 tie = larger ? _mm256_and_ps(a, b) : _mm256_or_ps(a, b);
    const __m256 tied = _mm256_blendv_ps(m, tie, _mm256_cmp_ps(a, b, _CMP_EQ_OQ));
    return _mm256_blendv_ps(tied, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
};

struct Divide8 {
  __m256 divisor;
  PCCL_AVX2_FN __m256 operator()(__m256 a, __m256) const { return _mm256_div_ps(a, divisor); }
};

// Wide<T>::step(dst, a, b, f): dst = f(a, b) on `width` values.
template <typename T> struct Wide;

template <> struct Wide<f16> {
  static constexpr int width = 8;
  template <typename F> PCCL_AVX2_FN static void step(f16* dst, const f16* a, const f16* b, F f) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(f(x, y), _MM_FROUND_TO_NEAREST_INT));
  }
};

template <> struct Wide<bf16> {
  static constexpr int width = 16;
  // A float's bits rounded to nearest even bf16, kept in the high 16 bits (low bits zero).
  // Unlike Num<bf16>::store this needs no NaN case: the floats here are sums, maxima,
  // minima or quotients of widened bf16 values, and a NaN among those is an operand's NaN
  // or the default NaN, both with zero low bits, which the rounding leaves as they are.
  PCCL_AVX2_FN static __m256i round(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  }
  template <typename F> PCCL_AVX2_FN static void step(bf16* dst, const bf16* a, const bf16* b, F f) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256 even = f(_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(y, 16)));
    const __m256 odd = f(_mm256_castsi256_ps(_mm256_and_si256(x, high)), _mm256_castsi256_ps(_mm256_and_si256(y, high)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm256_or_si256(_mm256_srli_epi32(round(even), 16), round(odd)));
  }
};

// dst = f(a, b) over the whole steps of n; returns how many elements it did.
template <typename T, typename F>
PCCL_AVX2_FN int64_t map_avx2(T* dst, const T* a, const T* b, int64_t n, F f) {
  int64_t i = 0;
  for (; i + Wide<T>::width <= n; i += Wide<T>::width) Wide<T>::step(dst + i, a + i, b + i, f);
  return i;
}

template <typename T, typename O>
PCCL_AVX2_FN void combine_avx2(T* dst, const T* a, const T* b, int64_t n) {
  const int64_t done = map_avx2(dst, a, b, n, Combine8<O>{});
  combine<T, O>(dst + done, a + done, b + done, n - done);
}

template <typename T>
PCCL_AVX2_FN void divide_avx2(T* buf, int64_t n, float divisor) {
  const int64_t done = map_avx2(buf, buf, buf, n, Divide8{_mm256_set1_ps(divisor)});
  divide(buf + done, n - done, divisor);
}

// F16C through cpuid: not every compiler's __builtin_cpu_supports knows "f16c".
bool has_avx2() {
  static const bool yes = [] {
    unsigned eax, ebx, ecx, edx;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  }();
  return yes;
}
#endif

template <typename T, typename O>
void run(void* dst, const void* a, const void* b, int64_t n) {
#ifdef PCCL_AVX2
  if constexpr (std::is_same_v<T, f16> || std::is_same_v<T, bf16>)
    if (has_avx2()) return combine_avx2<T, O>(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n);
#endif
  combine<T, O>(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n);
}

template <typename T>
void divide_half(T* buf, int64_t n, float divisor) {
#ifdef PCCL_AVX2
  if (has_avx2()) return divide_avx2(buf, n, divisor);
#endif
  divide(buf, n, divisor);
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

void divide(void* buf, int64_t n, DType dtype, int64_t divisor) {
  switch (dtype) {
    case DType::F32: return divide(static_cast<float*>(buf), n, static_cast<float>(divisor));
    case DType::F64: return divide(static_cast<double*>(buf), n, static_cast<double>(divisor));
    case DType::F16: return divide_half(static_cast<f16*>(buf), n, static_cast<float>(divisor));
    case DType::BF16: return divide_half(static_cast<bf16*>(buf), n, static_cast<float>(divisor));
    default: throw std::invalid_argument("dividing (op avg) needs a floating-point dtype");
  }
}

}  // namespace pccl
