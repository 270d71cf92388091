// One kernel source for CUDA and HIP: the few runtime names pccl uses, mapped per platform.
#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(PCCL_HIP)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#include <hip/hip_bf16.h>
using gpuStream_t = hipStream_t;
using gpuError_t = hipError_t;
using half_t = __half;
using bfloat16_t = __hip_bfloat16;
#define gpuSuccess hipSuccess
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemcpyDefault hipMemcpyDefault
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuSetDevice hipSetDevice
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
using gpuStream_t = cudaStream_t;
using gpuError_t = cudaError_t;
using half_t = __half;
using bfloat16_t = __nv_bfloat16;
#define gpuSuccess cudaSuccess
#define gpuGetErrorString cudaGetErrorString
#define gpuGetLastError cudaGetLastError
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemcpyDefault cudaMemcpyDefault
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuSetDevice cudaSetDevice
#endif
