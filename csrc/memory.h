// Where a collective's buffers live, host memory or a GPU (with the caller's stream),
// and the local work done there: copies, reductions, scaling, and waiting for the stream
// before MPI reads what kernels wrote.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "types.h"

namespace pccl {

struct Memory {
  int device = -1;         // -1: host memory; otherwise the GPU the buffers are on
  void* stream = nullptr;  // the caller's stream: local work is queued on it, in order
  bool staged = false;     // GPU buffers and an MPI that is not GPU-aware: messages go through host memory

  bool gpu() const { return device >= 0; }
  void activate() const;   // make `device` current on the calling thread
  void copy(void* dst, const void* src, size_t bytes) const;
  void reduce(void* dst, const void* a, const void* b, int64_t n, DType dtype, Op op) const;
  void scale(void* buf, int64_t n, DType dtype, double factor) const;
  void sync() const;       // GPU: wait until the stream's queued work is done
};

// A grow-only buffer in host or device memory, reused across calls.
class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace();
  char* get(size_t bytes, const Memory& where);

 private:
  std::vector<char> host_;
  char* device_ = nullptr;
  size_t device_bytes_ = 0;
};

}  // namespace pccl
