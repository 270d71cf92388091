// One kernel source for CUDA and HIP: the few runtime names pccl uses, spelled once and
// mapped to the platform's prefix (gpuMemcpyAsync is cudaMemcpyAsync or hipMemcpyAsync).
//
// Half-type conversions: the kernels call only names that both CUDA and every supported ROCm
// (5.7 and later; ROCm 5.6's hip_bf16.h includes an amd_hip_bf16.h it does not ship) define,
// with the same rounding: __half2float, __float2half_rn, __bfloat162float, __float2bfloat16.
// ROCm's amd_hip_bf16.h has no __float2bfloat16_rn (CUDA's other spelling). The ROCm
// releases checked are listed in docs/gpu.md, and tests/pccl/test_gpu.py keeps csrc/gpu to
// this list. In ROCm 5.7-6.0 amd_hip_bf16.h defines its functions non-inline, so only one
// translation unit (reduce.cu) may include this header.
#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(PCCL_HIP)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#include <hip/hip_bf16.h>
#define PCCL_GPU_NAME(name) hip##name
using bfloat16_t = __hip_bfloat16;
#define gpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define PCCL_GPU_NAME(name) cuda##name
using bfloat16_t = __nv_bfloat16;
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#endif

using half_t = __half;
using gpuStream_t = PCCL_GPU_NAME(Stream_t);
using gpuError_t = PCCL_GPU_NAME(Error_t);
#define gpuSuccess PCCL_GPU_NAME(Success)
#define gpuGetErrorString PCCL_GPU_NAME(GetErrorString)
#define gpuGetLastError PCCL_GPU_NAME(GetLastError)
#define gpuMemcpyAsync PCCL_GPU_NAME(MemcpyAsync)
#define gpuMemcpyDefault PCCL_GPU_NAME(MemcpyDefault)
#define gpuStreamSynchronize PCCL_GPU_NAME(StreamSynchronize)
using gpuEvent_t = PCCL_GPU_NAME(Event_t);
#define gpuEventCreateWithFlags PCCL_GPU_NAME(EventCreateWithFlags)
#define gpuEventDisableTiming PCCL_GPU_NAME(EventDisableTiming)
#define gpuEventRecord PCCL_GPU_NAME(EventRecord)
#define gpuEventSynchronize PCCL_GPU_NAME(EventSynchronize)
#define gpuEventDestroy PCCL_GPU_NAME(EventDestroy)
#define gpuSetDevice PCCL_GPU_NAME(SetDevice)
#define gpuGetDevice PCCL_GPU_NAME(GetDevice)
#define gpuDeviceGetAttribute PCCL_GPU_NAME(DeviceGetAttribute)
