// max and min of two values, one rule for every kernel that takes them: the CPU's reductions
// and codecs, and the GPU's (csrc/gpu includes this header). Half types come here widened.
//
// A NaN on either side wins, as in torch.maximum: `a > b ? a : b` alone kept b when a was
// NaN, so a NaN on one rank vanished or not by the schedule's order of operands. Between +0
// and -0, max takes +0 and min -0, as IEEE 754-2019's maximum and minimum do, where
// torch.maximum returns either operand (by their order and its kernel's path): which
// operand comes first is the schedule's choice, so ranks ended with zeros of different
// signs (and 1 / x with infinities of different signs). Equal values have the same bits, except +0 and -0: there max is the
// AND of the two bit patterns and min their OR, which moves only the sign.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PCCL_HOST_DEVICE __host__ __device__
#else
#define PCCL_HOST_DEVICE
#endif

namespace pccl {
namespace extrema {

template <typename T, bool Larger>
PCCL_HOST_DEVICE inline T tie(T a, T b) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "widened element types are 4 or 8 bytes");
  using Bits = std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t>;
  Bits x, y;
  memcpy(&x, &a, sizeof x);
  memcpy(&y, &b, sizeof y);
  x = Larger ? x & y : x | y;
  memcpy(&a, &x, sizeof x);
  return a;
}

template <typename T>
PCCL_HOST_DEVICE inline T larger(T a, T b) {
  return a > b || a != a ? a : a == b ? tie<T, true>(a, b) : b;
}

template <typename T>
PCCL_HOST_DEVICE inline T smaller(T a, T b) {
  return a < b || a != a ? a : a == b ? tie<T, false>(a, b) : b;
}

}  // namespace extrema
}  // namespace pccl
