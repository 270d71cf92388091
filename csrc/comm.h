// One MPI communicator as pccl uses it: a private duplicate of the caller's
// communicator, the schedule executor, the MPI library's own collectives, cached
// workspaces and the timeout. Calls on one object are serialized by the caller
// (pccl's Python layer keeps one queue per communicator) and guarded here too.
#pragma once
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "codec.h"
#include "memory.h"
#include "types.h"
#include "watchdog.h"

namespace pccl {

// Raised when peers do not arrive within the timeout; module.cpp maps it to
// pccl.core.errors.CollectiveTimeout (a TimeoutError).
struct Timeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Where block i of a buffer starts, in elements: `count` elements split over `blocks`
// blocks, the first count % blocks blocks one element longer (uneven blocks, no padding).
struct Layout {
  int64_t base, extra;
  Layout(int64_t count, int64_t blocks) : base(count / blocks), extra(count % blocks) {}
  int64_t offset(int64_t block) const { return block * base + (block < extra ? block : extra); }
};

class MpiComm {
 public:
  // gpu_aware: MPI may be handed device pointers (e.g. Cray MPICH with
  // MPICH_GPU_SUPPORT_ENABLED=1); otherwise GPU buffers are staged through pinned host
  // memory. allocate: where GPU and pinned workspaces come from. emulate_gpu (tests):
  // "GPU" buffers are host memory and their stream an EmulatedStream.
  MpiComm(MPI_Comm comm, double timeout_s, bool gpu_aware, Allocator allocate = nullptr, bool emulate_gpu = false);
  ~MpiComm();
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  void set_timeout(double timeout_s);
  // Where buffers on `device` (-1: host) with the caller's `stream` live, for this MPI.
  Memory memory(int device, void* stream) {
    return Memory{device, stream, device >= 0 && !gpu_aware_, emulate_gpu_ ? &emulated_ : nullptr};
  }
  const EmulatedStream::Stats& emulated_stats() const { return emulated_.stats(); }

  // Schedules: `ops` is the flat table of pccl.ir.schedule.Schedule.ops, `rows` x 5.
  // `count` is elements per rank (all-gather input, reduce-scatter output) or in total
  // (all-reduce). Local work on GPU buffers is queued on mem.stream. With a codec, `ops`
  // is pccl.ir.compressed.CompressedSchedule.ops and blocks travel encoded (host buffers).
  void all_gather(const int64_t* ops, int64_t rows, void* out, const void* in, int64_t count, DType dtype,
                  const Memory& mem, const Codec* codec = nullptr);
  void reduce_scatter(const int64_t* ops, int64_t rows, void* out, const void* in, int64_t count,
                      DType dtype, Op op, const Memory& mem, const Codec* codec = nullptr);
  void all_reduce(const int64_t* ops, int64_t rows, void* buf, int64_t count, DType dtype, Op op,
                  const Memory& mem, const Codec* codec = nullptr);

  // The MPI library's own collectives (the baseline), same argument meanings. polled: its
  // nonblocking form (MPI_Iallgather, ...), polled like a schedule's messages so that a
  // missing peer is a Timeout; else the blocking call under the watchdog.
  void native_all_gather(void* out, const void* in, int64_t count, DType dtype, const Memory& mem,
                         bool polled = false);
  void native_reduce_scatter(void* out, const void* in, int64_t count, DType dtype, Op op, const Memory& mem,
                             bool polled = false);
  void native_all_reduce(void* buf, int64_t count, DType dtype, Op op, const Memory& mem, bool polled = false);
  // Rank `root`'s `count` elements of buf, in place on every rank (MPI_Bcast).
  void native_broadcast(void* buf, int64_t count, DType dtype, int root, const Memory& mem, bool polled = false);
  // Returns once every rank has entered it (MPI_Barrier).
  void native_barrier(bool polled = false);

 private:
  // Runs a schedule on `buf`. With `source`, buf is a lazily filled copy of source: a
  // block is read from source until a receive lands in it (reduce-scatter's input stays
  // untouched without copying it whole first).
  void execute(const int64_t* ops, int64_t rows, char* buf, Layout layout, DType dtype, Op op,
               const Memory& mem, const char* source = nullptr);
  // The same for GPU buffers that MPI cannot take: messages travel through pinned host
  // memory, a mirror of the buffer, with copies queued on the stream (see comm.cpp).
  void execute_staged(const int64_t* ops, int64_t rows, char* buf, Layout layout, DType dtype, Op op,
                      const Memory& mem, const char* source);
  // A compressed schedule on host memory (see comm.cpp).
  void execute_compressed(const int64_t* ops, int64_t rows, char* buf, Layout layout, DType dtype, Op op,
                          const Codec& codec);
  void run(const int64_t* ops, int64_t rows, char* buf, Layout layout, DType dtype, Op op, const Memory& mem,
           const Codec* codec, const char* source = nullptr);
  const char* current(char* buf, const char* source, Layout layout, size_t esize, int64_t first, int64_t count,
                      const Memory& mem);
  void mark_touched(const char* source);  // the pending receives' blocks now hold their values in buf
  void post(bool is_send, char* ptr, int64_t bytes, int peer);
  void wait_all(int64_t step);
  // Polls `test` until it reports done; false once the timeout has passed (see comm.cpp).
  bool poll(const std::function<bool()>& test) const;
  std::string timed_out(const std::string& what);  // marks the communicator broken; the Timeout's text
  // A native collective: call(type, op, request) starts it (request non-null: nonblocking).
  using NativeCall = std::function<int(MPI_Datatype, MPI_Op, MPI_Request*)>;
  void native(const char* what, DType dtype, Op op, bool polled, const NativeCall& call);
  // Runs a native collective on the buffers, or on host copies where MPI cannot take them.
  void native_on(void* out, size_t out_bytes, const void* in, size_t in_bytes, const Memory& mem,
                 const std::function<void(void*, const void*)>& run);
  // fp16/bf16 reductions of GPU buffers: MPI moves the blocks (MPI_Alltoallv), the device
  // reduces them; the reduced block lands at out. `layout` splits `in` over the ranks.
  void alltoall_reduce(void* out, const void* in, Layout layout, DType dtype, Op op, const Memory& mem,
                       bool polled);
  void check_usable() const;
  void check(int err, const char* what);  // throws, and marks the communicator broken

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  double timeout_s_;
  bool gpu_aware_;
  Allocator allocate_;
  bool emulate_gpu_;
  EmulatedStream emulated_;
  std::vector<void*> events_;  // GPU events for Fences, made on first use
  bool broken_ = false;
  std::mutex mu_;
  Watchdog watchdog_;
  // Cached across calls so the steady state allocates nothing.
  Workspace work_{Workspace::kBuffers}, scratch_{Workspace::kBuffers}, gathered_{Workspace::kBuffers},
      encodings_{Workspace::kBuffers};
  Workspace mirror_{Workspace::kStaging}, landing_{Workspace::kStaging}, host_out_{Workspace::kStaging},
      host_in_{Workspace::kStaging};
  std::vector<MPI_Request> reqs_;
  std::vector<int> req_peers_;   // the peer of each request
  std::vector<char> req_sends_;  // whether each request is a send
  std::vector<int> world_ranks_;  // MPI_COMM_WORLD's rank of each rank, for messages
  std::vector<MPI_Status> statuses_;  // of the step's requests: which one failed, and why
  std::string waited_peers() const;
  void failed_requests(int err);  // throws naming the failed message, and marks the communicator broken
  // A receive to finish after the step: reduce it into place, or, staged, copy it to the device.
  struct Pending { int64_t first, count; char* dst; const char* a; char* landing; bool reduce; };
  std::vector<Pending> pending_;
  std::vector<const char*> send_from_;                // per send of the current step
  std::vector<char> touched_;                          // per block, when execute has a source
  std::vector<char> host_ok_;                          // staged, per block: the mirror holds its value
  std::vector<uint64_t> host_reader_;                  // staged, per block: fence of the copy reading its mirror
  std::vector<int64_t> encoded_at_;                    // compressed, per block: where its encoding lives
  std::vector<char> busy_, early_;                     // compressed, per block: in this step's messages; encoded ahead
};

}  // namespace pccl
