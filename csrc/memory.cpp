#include "memory.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "reduce.h"
#ifdef PCCL_GPU
#include "gpu/gpu.h"
#endif

namespace pccl {
namespace {

[[maybe_unused]] [[noreturn]] void no_gpu() {
  throw std::invalid_argument("pccl was built without GPU support; rebuild with make GPU=cuda (or hip)");
}

}  // namespace

// GPU work where the build has a GPU path; a clear error where it has none.
#ifdef PCCL_GPU
#define PCCL_ON_GPU(call) call
#else
#define PCCL_ON_GPU(call) no_gpu()
#endif

void EmulatedStream::push(std::function<void()> work, bool is_copy) {
  queue_.push_back(std::move(work));
  ++(is_copy ? stats_.copies : stats_.kernels);
}

void EmulatedStream::run_until(uint64_t position) {
  ++stats_.waits;
  for (; done_ < position && !queue_.empty(); ++done_) {
    queue_.front()();
    queue_.pop_front();
  }
}

struct EmulatedStream::Allocation : Block {
  Allocation(EmulatedStream& owner, size_t bytes) : owner(owner), storage(bytes) {
    data = storage.data();
    if (data != nullptr) owner.live_[data] = bytes;
  }
  ~Allocation() override { owner.live_.erase(data); }
  EmulatedStream& owner;
  std::vector<char> storage;
};

std::unique_ptr<Block> EmulatedStream::allocate(size_t bytes) { return std::make_unique<Allocation>(*this, bytes); }

void EmulatedStream::check(const void* ptr, size_t bytes, const char* what) const {
  const char* at = static_cast<const char*>(ptr);
  auto block = live_.upper_bound(at);
  if (bytes == 0 || block == live_.begin()) return;
  --block;
  const size_t offset = at - block->first;
  if (offset < block->second && bytes > block->second - offset)
    throw std::invalid_argument(std::string("pccl gpu (emulated): ") + what + " of " + std::to_string(bytes) +
                                " bytes at offset " + std::to_string(offset) + " runs past the end of a " +
                                std::to_string(block->second) + "-byte workspace");
}

void Memory::activate() const {
  if (gpu() && emulated == nullptr) PCCL_ON_GPU(gpu::set_device(device));
}
void Memory::copy(void* dst, const void* src, size_t bytes) const {
  if (!gpu()) return void(std::memcpy(dst, src, bytes));
  if (emulated != nullptr) {
    emulated->check(dst, bytes, "copy");
    emulated->check(src, bytes, "copy");
    return emulated->push([=] { std::memcpy(dst, src, bytes); }, true);
  }
  PCCL_ON_GPU(gpu::copy(dst, src, bytes, stream));
}
void Memory::reduce(void* dst, const void* a, const void* b, int64_t n, DType dtype, Op op) const {
  if (!gpu()) return pccl::reduce(dst, a, b, n, dtype, op);
  if (emulated != nullptr) {
    for (const void* p : {static_cast<const void*>(dst), a, b}) emulated->check(p, n * elem_size(dtype), "reduce");
    return emulated->push([=] { pccl::reduce(dst, a, b, n, dtype, op); }, false);
  }
  PCCL_ON_GPU(gpu::reduce(dst, a, b, n, dtype, op, stream));
}
void Memory::divide(void* buf, int64_t n, DType dtype, int64_t divisor) const {
  if (!gpu()) return pccl::divide(buf, n, dtype, divisor);
  if (emulated != nullptr) {
    emulated->check(buf, n * elem_size(dtype), "divide");
    return emulated->push([=] { pccl::divide(buf, n, dtype, divisor); }, false);
  }
  PCCL_ON_GPU(gpu::divide(buf, n, dtype, divisor, stream));
}
void Memory::sync() const {
  if (!gpu()) return;
  if (emulated != nullptr) return emulated->run_until(emulated->queued());
  PCCL_ON_GPU(gpu::sync(stream));
}

Fences::Fences(const Memory& mem, std::vector<void*>& events) : mem_(mem), events_(events) {}

uint64_t Fences::record() {
  if (!mem_.gpu()) return 0;  // host work is done when it returns
  const uint64_t ticket = ++recorded_;
  if (mem_.emulated != nullptr) {
    positions_.push_back(mem_.emulated->queued());
    return ticket;
  }
#ifdef PCCL_GPU
  constexpr size_t kRing = 8;  // the events of the device the communicator is used on, made once
  while (events_.size() < kRing) events_.push_back(gpu::event_create());
  gpu::event_record(events_[ticket % kRing], mem_.stream);
#endif
  return ticket;
}

void Fences::wait(uint64_t ticket) {
  if (ticket <= completed_) return;
  if (mem_.emulated != nullptr) {
    mem_.emulated->run_until(positions_[ticket - 1]);
  } else {
    PCCL_ON_GPU(gpu::event_wait(events_[ticket % events_.size()]));  // kRing events
  }
  completed_ = ticket;
}

char* Workspace::get(size_t bytes, const Memory& where, const Allocator& allocate) {
  if (!where.gpu()) {
    if (host_.size() < bytes) host_.resize(bytes);
    return host_.data();
  }
  if (block_ && stream_ != where.stream) {
    // Queued work of another stream may still use the block: let it finish first.
    Memory other = where;
    other.stream = stream_;
    other.sync();
  }
  if (!block_ || block_bytes_ < bytes || block_device_ != where.device) {
    if (block_) where.sync();  // queued work on the old block, before it is freed
    block_.reset();
    if (where.emulated != nullptr) {
      block_ = where.emulated->allocate(bytes);
    } else {
      if (!allocate) throw std::invalid_argument("pccl: GPU workspaces need an allocator (pccl's Python layer passes torch's)");
      block_ = allocate(bytes, kind_ == kBuffers ? where.device : -1, kind_ == kStaging);
    }
    block_bytes_ = bytes;
    block_device_ = where.device;
  }
  stream_ = where.stream;
  return block_->data;
}

}  // namespace pccl
