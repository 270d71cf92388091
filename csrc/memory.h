// Where a collective's buffers live, host memory or a GPU (with the caller's stream),
// and the local work done there: copies, reductions and divisions queued on the stream,
// fences the CPU waits for before MPI touches what the stream wrote, and workspaces.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "types.h"

namespace pccl {

// Memory handed out by an allocator (pccl's Python layer: torch's caching allocator for
// device memory, its pinned-host allocator for staging) and returned when the block dies.
struct Block {
  virtual ~Block() = default;
  char* data = nullptr;
};
using Allocator = std::function<std::unique_ptr<Block>(size_t bytes, int device, bool pinned)>;

// A stand-in for a GPU stream on host memory, for testing the GPU paths on machines
// without a GPU: queued work runs only when the CPU waits for it, so a missing wait
// before MPI reads a buffer, or a buffer reused while a queued copy still reads it,
// gives wrong results instead of passing by luck.
class EmulatedStream {
 public:
  struct Stats { int64_t copies = 0, kernels = 0, waits = 0; };
  void push(std::function<void()> work, bool is_copy);
  // Stand-in device (or pinned) memory: a block of its own, so that host and device
  // workspaces never share storage, and whose bounds every queued copy and kernel is
  // checked against, as a GPU's driver refuses a copy that runs past its allocation.
  std::unique_ptr<Block> allocate(size_t bytes);
  void check(const void* ptr, size_t bytes, const char* what) const;
  uint64_t queued() const { return done_ + queue_.size(); }
  void run_until(uint64_t position);  // runs queued work up to `position`, counts one wait
  const Stats& stats() const { return stats_; }

 private:
  struct Allocation;
  std::deque<std::function<void()>> queue_;
  uint64_t done_ = 0;
  Stats stats_;
  std::map<const char*, size_t> live_;  // the blocks handed out and not yet freed: start -> bytes
};

struct Memory {
  int device = -1;         // -1: host memory; otherwise the GPU the buffers are on
  void* stream = nullptr;  // the caller's stream: local work is queued on it, in order
  bool staged = false;     // GPU buffers and an MPI that is not GPU-aware: messages go through host memory
  EmulatedStream* emulated = nullptr;  // tests: a host-memory stand-in for the GPU and its stream

  bool gpu() const { return device >= 0; }
  void activate() const;   // make `device` current on the calling thread
  void copy(void* dst, const void* src, size_t bytes) const;
  void reduce(void* dst, const void* a, const void* b, int64_t n, DType dtype, Op op) const;
  void divide(void* buf, int64_t n, DType dtype, int64_t divisor) const;  // op avg's last step
  void sync() const;       // GPU: wait until the stream's queued work is done
};

// Points in a stream's queue that the CPU can wait for, so that it waits for what a
// step needs and not for everything queued (GPU: a ring of reusable events; a ticket
// whose event was recorded again stands for a later point, which only waits longer).
// Ticket 0 is "nothing", always complete.
class Fences {
 public:
  Fences(const Memory& mem, std::vector<void*>& events);
  uint64_t record();
  void wait(uint64_t ticket);

 private:
  const Memory& mem_;
  std::vector<void*>& events_;
  uint64_t recorded_ = 0, completed_ = 0;
  std::vector<uint64_t> positions_;  // emulated: the queue position of each ticket
};

// A grow-only buffer reused across calls, in the memory of the collective's buffers (host,
// or the GPU's) or, for staging, in host memory that the GPU's copy engines reach (pinned).
// One communicator takes host and GPU calls in any order, so the two are separate buffers,
// each with its own size. GPU and pinned memory come from the allocator; a block last used
// on another stream is waited for before this stream reuses or frees it.
class Workspace {
 public:
  enum Kind { kBuffers, kStaging };
  explicit Workspace(Kind kind) : kind_(kind) {}
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  char* get(size_t bytes, const Memory& where, const Allocator& allocate);

 private:
  Kind kind_;
  std::vector<char> host_;         // for calls on host buffers
  std::unique_ptr<Block> block_;   // for calls on GPU buffers
  size_t block_bytes_ = 0;
  int block_device_ = -1;          // a device buffer is used on the GPU it was made on
  void* stream_ = nullptr;         // the stream that last used the block
};

}  // namespace pccl
