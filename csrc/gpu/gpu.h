// GPU side of the native layer (built with -DPCCL_CUDA=ON or -DPCCL_HIP=ON): reduction
// kernels launched on the caller's stream. The host code includes only this header.
#pragma once
#include <cstddef>
#include <cstdint>

#include "../types.h"

namespace pccl::gpu {

// dst[i] = op(a[i], b[i]) on `stream` (dst may be a), every DType; the pointers may sit at
// any element offset (16-byte vectors where they share their offset modulo 16 bytes).
void reduce(void* dst, const void* a, const void* b, int64_t n, DType dtype, Op op, void* stream);
// A native codec (csrc/codec.h: 0 int8, 1 bf16, 2 fp16) on `stream`, the same encodings
// as the CPU's: encode n values of dtype into dst; decode into dst, op < 0 overwriting,
// else dst = op(dst, decoded).
void encode(int codec, void* dst, const void* src, int64_t n, DType dtype, void* stream);
void decode(int codec, void* dst, const void* src, int64_t n, DType dtype, int op, void* stream);
// buf[i] /= divisor on `stream`, a true division (half types in float, rounded once), as the
// CPU kernel divides (op avg).
void divide(void* buf, int64_t n, DType dtype, int64_t divisor, void* stream);
// Device-to-device (or any direction) copy on `stream`.
void copy(void* dst, const void* src, size_t bytes, void* stream);
// Wait until everything queued on `stream` is done (before MPI reads device memory).
void sync(void* stream);
// Events, to wait for a point in a stream's queue rather than for all of it. Workspaces
// come from torch's allocators (pccl's Python layer), not from here.
void* event_create();
void event_record(void* event, void* stream);
void event_wait(void* event);
void event_destroy(void* event);
// Make `device` current on the calling thread (collectives may run on a worker thread).
void set_device(int device);
// The platform the kernels were built for: "cuda" or "hip".
const char* platform();

}  // namespace pccl::gpu
