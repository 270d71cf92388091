// The native codecs on the GPU (csrc/codec.h): the same encodings as the CPU kernels, so
// an encoding made on either side decodes on the other. Included once, by reduce.cu (the
// only translation unit that may include compat.h), after its Num, Vec, Span and launch.
//
// int8: one block of kGroup threads per group of kGroup values (grid-stride over groups):
// each thread loads one value (coalesced), the block finds the largest |x| bit pattern in
// shared memory (an integer max, which also tells NaN and Inf apart, as on the CPU), then
// each thread writes its quantized value. Decoding, and the bf16/fp16 casts, are
// element-wise: functors for reduce.cu's vectorized `launch`.

constexpr int kCodecGroup = 128;   // == pccl::kGroup (quantize.h)

template <typename T>
__global__ void __launch_bounds__(kCodecGroup) int8_encode_kernel(char* out, const T* x, int64_t n) {
  __shared__ uint32_t top[kCodecGroup];
  __shared__ float scale;
  const int64_t groups = (n + kCodecGroup - 1) / kCodecGroup;
  int8_t* q = reinterpret_cast<int8_t*>(out + 4 * groups);
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {   // uniform over the block
    const int64_t i = g * kCodecGroup + threadIdx.x;
    const float v = i < n ? static_cast<float>(Num<T>::load(x[i])) : 0.0f;
    uint32_t bits;
    memcpy(&bits, &v, 4);
    top[threadIdx.x] = bits & 0x7fffffffu;
    __syncthreads();
    for (int half = kCodecGroup / 2; half > 0; half /= 2) {
      if (threadIdx.x < half && top[threadIdx.x + half] > top[threadIdx.x]) top[threadIdx.x] = top[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      float largest;
      memcpy(&largest, &top[0], 4);
      scale = top[0] >= 0x7f800000u ? NAN : largest / 127.0f;
      memcpy(out + 4 * g, &scale, 4);   // byte stores: an encoding may start at any byte (unpadded in a message)
    }
    __syncthreads();
    if (i < n) {
      const float s = scale;
      float r = 0.0f;
      if (s >= 1e-36f) {
        r = rintf(fmaxf(-127.0f, fminf(127.0f, v * (1.0f / s))));
      } else if (s > 0.0f) {   // subnormal scale: 1 / s would overflow
        r = rintf(fmaxf(-127.0f, fminf(127.0f, v / s)));   // as the CPU clamps: v / s can round past 127
      }
      q[i] = static_cast<int8_t>(r);
    }
    __syncthreads();   // `top` and `scale` are reused by the next group
  }
}

// op(a, v): a decoded value v reduced into a (op >= 0; where op < 0, callers store v).
__device__ inline float decoded(int op, float a, float v) {
  return op == static_cast<int>(Op::Max)   ? extrema::larger(a, v)
         : op == static_cast<int>(Op::Min) ? extrema::smaller(a, v)
                                           : a + v;
}

template <typename T>
struct Int8Decode {
  static constexpr int kWidth = 16 / sizeof(T);
  T* x;
  const char* scales;   // bytes, not floats: an encoding packed after another starts at any byte
  const int8_t* q;
  int op;
  std::array<Span, 2> spans() const { return {{{x, sizeof(T)}, {q, 1}}}; }
  template <int N> __device__ void run(int64_t i) const {
    const Vec<int8_t, N> c = load_vec<N>(q + i);
    Vec<T, N> y;
    if (op >= 0) y = load_vec<N>(x + i);   // overwriting needs no read
    // A vector (N <= 16 values) may straddle two groups: the head shifts vectors off group
    // boundaries. Elements from `next` on take the second group's scale.
    const int64_t group = i / kCodecGroup, next = (group + 1) * kCodecGroup - i;
    float first_scale, second_scale;
    memcpy(&first_scale, scales + 4 * group, 4);
    memcpy(&second_scale, scales + 4 * ((i + N - 1) / kCodecGroup), 4);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      // the decoded value in T, whether stored or reduced, as on the CPU (quantize.cpp)
      const T d = Num<T>::store(static_cast<float>(c.v[j]) * (j < next ? first_scale : second_scale));
      y.v[j] = op < 0 ? d : Num<T>::store(decoded(op, Num<T>::load(y.v[j]), Num<T>::load(d)));
    }
    store_vec<N>(x + i, y);
  }
};

// fp32 values carried as H (half_t or bfloat16_t), round to nearest even.
template <typename H>
struct Narrow {
  static constexpr int kWidth = 4;   // 16 bytes of fp32 in, 8 of H out
  H* out;
  const float* x;
  std::array<Span, 2> spans() const { return {{{out, sizeof(H)}, {x, sizeof(float)}}}; }
  template <int N> __device__ void run(int64_t i) const {
    const Vec<float, N> v = load_vec<N>(x + i);
    Vec<H, N> h;
#pragma unroll
    for (int j = 0; j < N; ++j) h.v[j] = Num<H>::store(v.v[j]);
    store_vec<N>(out + i, h);
  }
};

template <typename H>
struct Widen {
  static constexpr int kWidth = 4;
  float* x;
  const H* in;
  int op;
  std::array<Span, 2> spans() const { return {{{x, sizeof(float)}, {in, sizeof(H)}}}; }
  template <int N> __device__ void run(int64_t i) const {
    const Vec<H, N> h = load_vec<N>(in + i);
    Vec<float, N> y;
    if (op >= 0) y = load_vec<N>(x + i);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float v = Num<H>::load(h.v[j]);
      y.v[j] = op < 0 ? v : decoded(op, y.v[j], v);
    }
    store_vec<N>(x + i, y);
  }
};

int codec_groups_grid(int64_t n) {
  const int64_t groups = (n + kCodecGroup - 1) / kCodecGroup;
  return static_cast<int>(groups < 65535 ? groups : 65535);
}

template <typename F>
void by_float_dtype(DType dtype, F f) {
  switch (dtype) {
    case DType::F32: return f(static_cast<float*>(nullptr));
    case DType::F16: return f(static_cast<half_t*>(nullptr));
    case DType::BF16: return f(static_cast<bfloat16_t*>(nullptr));
    default: throw std::invalid_argument("int8 quantization takes float32, float16 or bfloat16 values");
  }
}

void check_codec(int codec, DType dtype) {
  if (codec < 0 || codec > 2) throw std::invalid_argument("unknown native codec code " + std::to_string(codec));
  if (codec != 0 && dtype != DType::F32) throw std::invalid_argument("the bf16 and fp16 codecs take float32 values");
}

// Calls int8(T*) for the int8 codec (T: the payload's type), else cast(H*) (H: the wire
// type of the bf16 or fp16 cast), after checking the codec takes `dtype`.
template <typename Int8, typename Cast>
void by_codec(int codec, DType dtype, Int8 int8, Cast cast) {
  check_codec(codec, dtype);
  if (codec == 0) return by_float_dtype(dtype, int8);
  if (codec == 1) return cast(static_cast<bfloat16_t*>(nullptr));
  cast(static_cast<half_t*>(nullptr));
}
