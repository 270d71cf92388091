// Reduction and codec kernels for CUDA and HIP from one source (see compat.h). Half types are
// combined in float and rounded once, as the CPU kernels and torch do. Each thread
// handles a grid-stride range, so any n (64-bit) fits a bounded grid.
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "compat.h"
#include "gpu.h"

namespace pccl::gpu {
namespace {

template <typename T> struct Num {
  using Acc = T;
  __device__ static T load(T v) { return v; }
  __device__ static T store(T v) { return v; }
};
template <> struct Num<half_t> {
  using Acc = float;
  __device__ static float load(half_t v) { return __half2float(v); }
  __device__ static half_t store(float f) { return __float2half_rn(f); }
};
template <> struct Num<bfloat16_t> {
  using Acc = float;
  __device__ static float load(bfloat16_t v) { return __bfloat162float(v); }
  // __float2bfloat16 rounds to nearest even (NaN stays NaN) in cuda_bf16.h and in every
  // ROCm's amd_hip_bf16.h; ROCm has no __float2bfloat16_rn (see compat.h).
  __device__ static bfloat16_t store(float f) { return __float2bfloat16(f); }
};

struct SumOp { template <typename T> __device__ static T apply(T a, T b) { return a + b; } };
struct MaxOp { template <typename T> __device__ static T apply(T a, T b) { return a > b ? a : b; } };
struct MinOp { template <typename T> __device__ static T apply(T a, T b) { return a < b ? a : b; } };

template <typename T, typename O>
__global__ void combine(T* dst, const T* a, const T* __restrict__ b, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = Num<T>::store(O::apply(Num<T>::load(a[i]), Num<T>::load(b[i])));
}

// A true division (IEEE-rounded: no fast-math flags in this build), not torch's CUDA
// x * (1 / divisor): op avg has one meaning on every device.
template <typename T>
__global__ void divide(T* buf, int64_t n, typename Num<T>::Acc divisor) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    buf[i] = Num<T>::store(Num<T>::load(buf[i]) / divisor);
}

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  return static_cast<int>(wanted < 65535 ? (wanted > 0 ? wanted : 1) : 65535);
}

void check(gpuError_t err, const char* what) {
  if (err != gpuSuccess) throw std::runtime_error(std::string("pccl gpu: ") + what + ": " + gpuGetErrorString(err));
}

template <typename T, typename O>
void launch(void* dst, const void* a, const void* b, int64_t n, void* stream) {
  combine<T, O><<<blocks_for(n), kThreads, 0, static_cast<gpuStream_t>(stream)>>>(
      static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n);
  check(gpuGetLastError(), "reduce kernel launch");
}

template <typename O>
void by_dtype(void* dst, const void* a, const void* b, int64_t n, DType dtype, void* stream) {
  switch (dtype) {
    case DType::F32: return launch<float, O>(dst, a, b, n, stream);
    case DType::F64: return launch<double, O>(dst, a, b, n, stream);
    case DType::F16: return launch<half_t, O>(dst, a, b, n, stream);
    case DType::BF16: return launch<bfloat16_t, O>(dst, a, b, n, stream);
    case DType::I32: return launch<int32_t, O>(dst, a, b, n, stream);
    case DType::I64: return launch<int64_t, O>(dst, a, b, n, stream);
  }
  throw std::invalid_argument("unknown dtype code");
}

#include "codec.cuh"

template <typename T>
void launch_divide(void* buf, int64_t n, typename Num<T>::Acc divisor, void* stream) {
  divide<T><<<blocks_for(n), kThreads, 0, static_cast<gpuStream_t>(stream)>>>(static_cast<T*>(buf), n, divisor);
  check(gpuGetLastError(), "divide kernel launch");
}

}  // namespace

void reduce(void* dst, const void* a, const void* b, int64_t n, DType dtype, Op op, void* stream) {
  if (n == 0) return;
  switch (op) {
    case Op::Sum: case Op::Avg: return by_dtype<SumOp>(dst, a, b, n, dtype, stream);
    case Op::Max: return by_dtype<MaxOp>(dst, a, b, n, dtype, stream);
    case Op::Min: return by_dtype<MinOp>(dst, a, b, n, dtype, stream);
  }
  throw std::invalid_argument("unknown op code");
}

void divide(void* buf, int64_t n, DType dtype, int64_t divisor, void* stream) {
  if (n == 0) return;
  switch (dtype) {
    case DType::F32: return launch_divide<float>(buf, n, static_cast<float>(divisor), stream);
    case DType::F64: return launch_divide<double>(buf, n, static_cast<double>(divisor), stream);
    case DType::F16: return launch_divide<half_t>(buf, n, static_cast<float>(divisor), stream);
    case DType::BF16: return launch_divide<bfloat16_t>(buf, n, static_cast<float>(divisor), stream);
    default: throw std::invalid_argument("dividing (op avg) needs a floating-point dtype");
  }
}

void encode(int codec, void* dst, const void* src, int64_t n, DType dtype, void* stream) {
  if (n == 0) return check_codec(codec, dtype);
  auto s = static_cast<gpuStream_t>(stream);
  by_codec(
      codec, dtype,
      [&](auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        int8_encode_kernel<T><<<codec_groups_grid(n), kCodecGroup, 0, s>>>(static_cast<char*>(dst),
                                                                            static_cast<const T*>(src), n);
      },
      [&](auto* wire) {
        using H = std::remove_pointer_t<decltype(wire)>;
        narrow_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<H*>(dst), static_cast<const float*>(src), n);
      });
  check(gpuGetLastError(), "encode kernel launch");
}

void decode(int codec, void* dst, const void* src, int64_t n, DType dtype, int op, void* stream) {
  if (n == 0) return check_codec(codec, dtype);
  auto s = static_cast<gpuStream_t>(stream);
  by_codec(
      codec, dtype,
      [&](auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        int8_decode_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(dst), static_cast<const char*>(src),
                                                                  n, op);
      },
      [&](auto* wire) {
        using H = std::remove_pointer_t<decltype(wire)>;
        widen_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<float*>(dst), static_cast<const H*>(src), n, op);
      });
  check(gpuGetLastError(), "decode kernel launch");
}

void copy(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(gpuMemcpyAsync(dst, src, bytes, gpuMemcpyDefault, static_cast<gpuStream_t>(stream)), "copy");
}

void set_device(int device) { check(gpuSetDevice(device), "set device"); }

void sync(void* stream) { check(gpuStreamSynchronize(static_cast<gpuStream_t>(stream)), "stream synchronize"); }

void* event_create() {
  gpuEvent_t event;
  check(gpuEventCreateWithFlags(&event, gpuEventDisableTiming), "create event");
  return event;
}

void event_record(void* event, void* stream) {
  check(gpuEventRecord(static_cast<gpuEvent_t>(event), static_cast<gpuStream_t>(stream)), "record event");
}

void event_wait(void* event) { check(gpuEventSynchronize(static_cast<gpuEvent_t>(event)), "wait for event"); }

void event_destroy(void* event) { gpuEventDestroy(static_cast<gpuEvent_t>(event)); }

const char* platform() {
#if defined(__HIP_PLATFORM_AMD__) || defined(PCCL_HIP)
  return "hip";
#else
  return "cuda";
#endif
}

}  // namespace pccl::gpu
