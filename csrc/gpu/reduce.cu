// Reduction and codec kernels for CUDA and HIP from one source (see compat.h). Half types are
// combined in float and rounded once, as the CPU kernels and torch do.
//
// Every kernel here is element-wise and memory bound, so all run through one loop
// (`elementwise`): each thread moves N elements with one load/store per buffer (16 bytes
// for the widest buffer), over a grid-stride range sized for the device, so any n (64-bit)
// fits. pccl reduces blocks at any element offset: the few elements before the buffers
// reach a vector boundary, and those after the last whole vector, go one at a time. When
// the buffers' offsets differ modulo the vector, a narrower vector (down to one element)
// is used; a buffer off its element's alignment (an encoding at any byte) moves bytes.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../extrema.h"
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
// the CPU's rule (csrc/extrema.h): a NaN on either side wins; max(+0, -0) is +0, min -0
struct MaxOp { template <typename T> __device__ static T apply(T a, T b) { return extrema::larger(a, b); } };
struct MinOp { template <typename T> __device__ static T apply(T a, T b) { return extrema::smaller(a, b); } };

// One load/store instruction of B bytes (the vector types compile to 128/64-bit accesses).
template <int B> struct Raw;
template <> struct Raw<16> { using type = uint4; };
template <> struct Raw<8> { using type = uint2; };
template <> struct Raw<4> { using type = uint32_t; };
template <> struct Raw<2> { using type = uint16_t; };
template <> struct Raw<1> { using type = uint8_t; };

template <typename T, int N> struct Vec { T v[N]; };

// p must be aligned to N * sizeof(T) where N > 1 (the launcher's head guarantees it). One
// element may sit at any byte: an encoding packed after another in a message (int8's is
// any number of bytes long) puts a bf16 or fp16 wire value at an odd address, which a
// 2-byte load stops the kernel on (misaligned address), as the CPU's memcpy does not. So
// a lone element off its alignment moves a byte at a time (the branch is uniform over a
// buffer). memcpy between registers compiles to nothing and keeps the type punning defined.
template <typename T>
__device__ bool off_alignment(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(T) != 0;
}

template <int N, typename T>
__device__ Vec<T, N> load_vec(const T* p) {
  static_assert(N * sizeof(T) <= 16, "vectors are at most 16 bytes");
  Vec<T, N> x;
  if (N == 1 && off_alignment(p)) {
    unsigned char b[sizeof(T)];
    for (size_t k = 0; k < sizeof(T); ++k) b[k] = reinterpret_cast<const unsigned char*>(p)[k];
    memcpy(&x, b, sizeof b);
    return x;
  }
  using R = typename Raw<N * sizeof(T)>::type;
  const R r = *reinterpret_cast<const R*>(p);
  memcpy(&x, &r, sizeof r);
  return x;
}

template <int N, typename T>
__device__ void store_vec(T* p, const Vec<T, N>& x) {
  if (N == 1 && off_alignment(p)) {
    unsigned char b[sizeof(T)];
    memcpy(b, &x, sizeof b);
    for (size_t k = 0; k < sizeof(T); ++k) reinterpret_cast<unsigned char*>(p)[k] = b[k];
    return;
  }
  using R = typename Raw<N * sizeof(T)>::type;
  R r;
  memcpy(&r, &x, sizeof r);
  *reinterpret_cast<R*>(p) = r;
}

constexpr int kThreads = 256;

// Vectors [0, vecs) cover elements [head, head + vecs * N); the rest (fewer than 2N: the
// head and the tail) go one element at a time. Each element is read and written by one
// thread only, so dst may be a source (in place).
template <int N, typename F>
__global__ void __launch_bounds__(kThreads) elementwise(F f, int64_t head, int64_t vecs, int64_t n) {
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = first; v < vecs; v += stride) f.template run<N>(head + v * N);
  const int64_t end = head + vecs * N, rest = head + (n - end);
  for (int64_t t = first; t < rest; t += stride) f.template run<1>(t < head ? t : end + (t - head));
}

// A buffer of elements of `size` bytes, for choosing the vector.
struct Span {
  const void* p;
  size_t size;
};

// The elements to skip before every buffer sits on an N-element boundary (the same count
// for all), or -1 where none does (their offsets differ modulo N elements, or a pointer is
// not aligned to its element).
template <size_t K>
int64_t vector_head(int N, const std::array<Span, K>& spans) {
  int64_t head = -1;
  for (const Span& s : spans) {
    const auto addr = reinterpret_cast<uintptr_t>(s.p);
    if (addr % s.size != 0) return -1;
    const int64_t h = (N - static_cast<int64_t>((addr / s.size) % N)) % N;
    if (head >= 0 && h != head) return -1;
    head = h;
  }
  return head;
}

void check(gpuError_t err, const char* what) {
  if (err != gpuSuccess) throw std::runtime_error(std::string("pccl gpu: ") + what + ": " + gpuGetErrorString(err));
}

// The current device's SM (CU) count, asked once per device: the grid is a multiple of it.
int sm_count() {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices];   // 0: not asked yet
  int device = 0;
  check(gpuGetDevice(&device), "get device");
  int sms = device >= 0 && device < kDevices ? known[device].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    check(gpuDeviceGetAttribute(&sms, gpuDevAttrMultiProcessorCount, device), "get SM count");
    sms = std::max(sms, 1);
    if (device >= 0 && device < kDevices) known[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// Enough blocks for one unit of work per thread, capped at 32 blocks per SM (4 waves of
// 8 resident 256-thread blocks): past that, threads loop.
constexpr int64_t kBlocksPerSm = 32;

int grid_for(int64_t work) {
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, kBlocksPerSm * sm_count())));
}

// Runs f over n elements with N-element vectors, or narrower ones where the buffers'
// offsets (f.spans()) do not allow N.
template <int N, typename F>
void launch(const F& f, int64_t n, void* stream, const char* what) {
  int64_t head = vector_head(N, f.spans());
  if (N > 1 && head < 0) return launch<(N > 1 ? N / 2 : 1)>(f, n, stream, what);
  head = std::min(std::max<int64_t>(head, 0), n);   // N == 1: always 0
  const int64_t vecs = (n - head) / N, rest = n - vecs * N;
  elementwise<N><<<grid_for(std::max(vecs, rest)), kThreads, 0, static_cast<gpuStream_t>(stream)>>>(f, head, vecs, n);
  check(gpuGetLastError(), what);
}

// dst = op(a, b). dst may be a, so neither is __restrict__.
template <typename T, typename O>
struct Combine {
  static constexpr int kWidth = 16 / sizeof(T);
  T* dst;
  const T* a;
  const T* b;
  std::array<Span, 3> spans() const { return {{{dst, sizeof(T)}, {a, sizeof(T)}, {b, sizeof(T)}}}; }
  template <int N> __device__ void run(int64_t i) const {
    const Vec<T, N> x = load_vec<N>(a + i), y = load_vec<N>(b + i);
    Vec<T, N> z;
#pragma unroll
    for (int j = 0; j < N; ++j) z.v[j] = Num<T>::store(O::apply(Num<T>::load(x.v[j]), Num<T>::load(y.v[j])));
    store_vec<N>(dst + i, z);
  }
};

// A true division (IEEE-rounded: no fast-math flags in this build), not torch's CUDA
// x * (1 / divisor): op avg has one meaning on every device.
template <typename T>
struct Divide {
  static constexpr int kWidth = 16 / sizeof(T);
  T* buf;
  typename Num<T>::Acc divisor;
  std::array<Span, 1> spans() const { return {{{buf, sizeof(T)}}}; }
  template <int N> __device__ void run(int64_t i) const {
    Vec<T, N> x = load_vec<N>(buf + i);
#pragma unroll
    for (int j = 0; j < N; ++j) x.v[j] = Num<T>::store(Num<T>::load(x.v[j]) / divisor);
    store_vec<N>(buf + i, x);
  }
};

template <typename T, typename O>
void launch_combine(void* dst, const void* a, const void* b, int64_t n, void* stream) {
  using F = Combine<T, O>;
  launch<F::kWidth>(F{static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b)}, n, stream,
                    "reduce kernel launch");
}

template <typename O>
void by_dtype(void* dst, const void* a, const void* b, int64_t n, DType dtype, void* stream) {
  switch (dtype) {
    case DType::F32: return launch_combine<float, O>(dst, a, b, n, stream);
    case DType::F64: return launch_combine<double, O>(dst, a, b, n, stream);
    case DType::F16: return launch_combine<half_t, O>(dst, a, b, n, stream);
    case DType::BF16: return launch_combine<bfloat16_t, O>(dst, a, b, n, stream);
    case DType::I32: return launch_combine<int32_t, O>(dst, a, b, n, stream);
    case DType::I64: return launch_combine<int64_t, O>(dst, a, b, n, stream);
  }
  throw std::invalid_argument("unknown dtype code");
}

#include "codec.cuh"

template <typename T>
void launch_divide(void* buf, int64_t n, typename Num<T>::Acc divisor, void* stream) {
  launch<Divide<T>::kWidth>(Divide<T>{static_cast<T*>(buf), divisor}, n, stream, "divide kernel launch");
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
        check(gpuGetLastError(), "encode kernel launch");
      },
      [&](auto* wire) {
        using H = std::remove_pointer_t<decltype(wire)>;
        launch<Narrow<H>::kWidth>(Narrow<H>{static_cast<H*>(dst), static_cast<const float*>(src)}, n, stream,
                                  "encode kernel launch");
      });
}

void decode(int codec, void* dst, const void* src, int64_t n, DType dtype, int op, void* stream) {
  if (n == 0) return check_codec(codec, dtype);
  by_codec(
      codec, dtype,
      [&](auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        const auto* in = static_cast<const char*>(src);
        const int64_t groups = (n + kCodecGroup - 1) / kCodecGroup;
        const Int8Decode<T> f{static_cast<T*>(dst), in,
                              reinterpret_cast<const int8_t*>(in + 4 * groups), op};
        launch<Int8Decode<T>::kWidth>(f, n, stream, "decode kernel launch");
      },
      [&](auto* wire) {
        using H = std::remove_pointer_t<decltype(wire)>;
        launch<Widen<H>::kWidth>(Widen<H>{static_cast<float*>(dst), static_cast<const H*>(src), op}, n, stream,
                                 "decode kernel launch");
      });
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
