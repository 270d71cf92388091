// The native codecs on the GPU (csrc/codec.h): the same encodings as the CPU kernels, so
// an encoding made on either side decodes on the other. Included once, by reduce.cu (the
// only translation unit that may include compat.h), after its Num, check, blocks_for and
// kThreads.
//
// int8: one block of kGroup threads per group of kGroup values (grid-stride over groups):
// each thread loads one value (coalesced), the block finds the largest |x| bit pattern in
// shared memory (an integer max, which also tells NaN and Inf apart, as on the CPU), then
// each thread writes its quantized value. Decoding is element-wise.

constexpr int kCodecGroup = 128;   // == pccl::kGroup (quantize.h)

template <typename T>
__global__ void __launch_bounds__(kCodecGroup) int8_encode_kernel(char* out, const T* x, int64_t n) {
  __shared__ uint32_t top[kCodecGroup];
  __shared__ float scale;
  const int64_t groups = (n + kCodecGroup - 1) / kCodecGroup;
  float* scales = reinterpret_cast<float*>(out);
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
      scales[g] = scale;
    }
    __syncthreads();
    if (i < n) {
      const float s = scale;
      float r = 0.0f;
      if (s >= 1e-36f) {
        r = rintf(fmaxf(-127.0f, fminf(127.0f, v * (1.0f / s))));
      } else if (s > 0.0f) {   // subnormal scale: 1 / s would overflow
        r = rintf(v / s);
      }
      q[i] = static_cast<int8_t>(r);
    }
    __syncthreads();   // `top` and `scale` are reused by the next group
  }
}

template <typename T>
__global__ void int8_decode_kernel(T* x, const char* in, int64_t n, int op) {
  const int64_t groups = (n + kCodecGroup - 1) / kCodecGroup;
  const float* scales = reinterpret_cast<const float*>(in);
  const int8_t* q = reinterpret_cast<const int8_t*>(in + 4 * groups);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = static_cast<float>(q[i]) * scales[i / kCodecGroup];
    const float a = Num<T>::load(x[i]);
    x[i] = Num<T>::store(op < 0 ? v : op == static_cast<int>(Op::Max) ? (a > v ? a : v)
                                    : op == static_cast<int>(Op::Min) ? (a < v ? a : v) : a + v);
  }
}

// fp32 values carried as H (half_t or bfloat16_t), round to nearest even.
template <typename H>
__global__ void narrow_kernel(H* out, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = Num<H>::store(x[i]);
}

template <typename H>
__global__ void widen_kernel(float* x, const H* in, int64_t n, int op) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = Num<H>::load(in[i]), a = x[i];
    x[i] = op < 0 ? v : op == static_cast<int>(Op::Max) ? (a > v ? a : v)
                      : op == static_cast<int>(Op::Min) ? (a < v ? a : v) : a + v;
  }
}

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
