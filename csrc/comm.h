// One MPI communicator as pccl uses it: a private duplicate of the caller's
// communicator, the schedule executor, the MPI library's own collectives, cached
// workspaces and the timeout. Calls on one object are serialized by the caller
// (pccl's Python layer keeps one queue per communicator) and guarded here too.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "types.h"
#include "watchdog.h"

namespace pccl {

// Raised when peers do not arrive within the timeout; mapped to Python's TimeoutError.
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
  MpiComm(MPI_Comm comm, double timeout_s);
  ~MpiComm();
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  void set_timeout(double timeout_s);

  // Schedules: `ops` is the flat table of pccl.schedule.Schedule.ops, `rows` x 5.
  // `count` is elements per rank (all-gather input, reduce-scatter output) or in total
  // (all-reduce).
  void all_gather(const int64_t* ops, int64_t rows, void* out, const void* in, int64_t count, DType dtype);
  void reduce_scatter(const int64_t* ops, int64_t rows, void* out, const void* in, int64_t count,
                      DType dtype, Op op);
  void all_reduce(const int64_t* ops, int64_t rows, void* buf, int64_t count, DType dtype, Op op);

  // The MPI library's own collectives (the baseline), same argument meanings.
  void native_all_gather(void* out, const void* in, int64_t count, DType dtype);
  void native_reduce_scatter(void* out, const void* in, int64_t count, DType dtype, Op op);
  void native_all_reduce(void* buf, int64_t count, DType dtype, Op op);

 private:
  // Runs a schedule on `buf`. With `source`, buf is a lazily filled copy of source: a
  // block is read from source until a receive lands in it (reduce-scatter's input stays
  // untouched without copying it whole first).
  void execute(const int64_t* ops, int64_t rows, char* buf, Layout layout, DType dtype, Op op,
               const char* source = nullptr);
  const char* current(char* buf, const char* source, Layout layout, size_t esize, int64_t first, int64_t count);
  void post(bool is_send, char* ptr, int64_t bytes, int peer);
  void wait_all(int64_t step);
  void native(const char* what, void* result, int64_t result_count, DType dtype, Op op,
              const std::function<int(MPI_Datatype, MPI_Op)>& call);
  void check_usable() const;
  void check(int err, const char* what);  // throws, and marks the communicator broken
  char* workspace(std::vector<char>& space, size_t bytes);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  double timeout_s_;
  bool broken_ = false;
  std::mutex mu_;
  Watchdog watchdog_;
  // Cached across calls so the steady state allocates nothing.
  std::vector<char> work_, scratch_;
  std::vector<MPI_Request> reqs_;
  std::vector<int> req_peers_;
  struct Pending { char* dst; const char* a; const char* b; int64_t elems; };
  std::vector<Pending> reductions_;
  std::vector<char> touched_;                          // per block, when execute has a source
  std::vector<std::pair<int64_t, int64_t>> landed_;    // runs received in the current step
};

}  // namespace pccl
