#include "memory.h"

#include <cstring>
#include <stdexcept>

#include "reduce.h"
#ifdef PCCL_GPU
#include "gpu/gpu.h"
#endif

namespace pccl {
#ifndef PCCL_GPU
namespace {

[[noreturn]] void no_gpu() {
  throw std::invalid_argument("pccl was built without GPU support; rebuild with make GPU=cuda (or hip)");
}

}  // namespace
#endif

// GPU work where the build has a GPU path; a clear error where it has none.
#ifdef PCCL_GPU
#define PCCL_ON_GPU(call) call
#else
#define PCCL_ON_GPU(call) no_gpu()
#endif

void Memory::activate() const { if (gpu()) PCCL_ON_GPU(gpu::set_device(device)); }
void Memory::copy(void* dst, const void* src, size_t bytes) const {
  gpu() ? PCCL_ON_GPU(gpu::copy(dst, src, bytes, stream)) : void(std::memcpy(dst, src, bytes));
}
void Memory::reduce(void* dst, const void* a, const void* b, int64_t n, DType dtype, Op op) const {
  gpu() ? PCCL_ON_GPU(gpu::reduce(dst, a, b, n, dtype, op, stream)) : pccl::reduce(dst, a, b, n, dtype, op);
}
void Memory::scale(void* buf, int64_t n, DType dtype, double factor) const {
  gpu() ? PCCL_ON_GPU(gpu::scale(buf, n, dtype, factor, stream)) : pccl::scale(buf, n, dtype, factor);
}
void Memory::sync() const { if (gpu()) PCCL_ON_GPU(gpu::sync(stream)); }

char* Workspace::get(size_t bytes, const Memory& where) {
  if (!where.gpu()) {
    if (host_.size() < bytes) host_.resize(bytes);
    return host_.data();
  }
#ifdef PCCL_GPU
  if (device_bytes_ < bytes) {
    where.sync();  // work queued on the old buffer must finish before it is freed
    gpu::release(device_);
    device_ = static_cast<char*>(gpu::alloc(bytes));
    device_bytes_ = bytes;
  }
  return device_;
#else
  no_gpu();
#endif
}

Workspace::~Workspace() {
#ifdef PCCL_GPU
  if (device_ != nullptr) gpu::release(device_);
#endif
}

}  // namespace pccl
