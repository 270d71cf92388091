// The MPI library's own collectives behind pccl's API: the baseline pccl's schedules
// are measured against. fp16 and bf16, which MPI does not know, travel as 2-byte types;
// in host memory pccl's kernels reduce them through user-defined MPI operations, and on a
// GPU (where a user-defined operation, host code, cannot read the buffers) MPI only moves
// them and the device reduces (alltoall_reduce).
#include <functional>
#include <limits>
#include <mutex>
#include <vector>

#include "comm.h"
#include "reduce.h"

namespace pccl {
namespace {

// MPI-4 libraries take 64-bit counts (the _c functions); older ones take int.
#if MPI_VERSION >= 4
using Count = MPI_Count;
using Displacement = MPI_Aint;
#define PCCL_MPI(fn) fn##_c
#else
using Count = int;
using Displacement = int;
#define PCCL_MPI(fn) fn
#endif

template <DType D, Op O>
void user_reduce(void* in, void* inout, Count* len, MPI_Datatype*) {
  reduce_into(inout, in, *len, D, O);
}

struct HalfTypes {
  MPI_Datatype f16, bf16;
  MPI_Op ops[2][3];  // [f16, bf16][sum, max, min]
};

const HalfTypes& half_types() {
  static HalfTypes t;
  static std::once_flag once;
  std::call_once(once, [] {
    MPI_Type_contiguous(2, MPI_BYTE, &t.f16);
    MPI_Type_commit(&t.f16);
    MPI_Type_contiguous(2, MPI_BYTE, &t.bf16);
    MPI_Type_commit(&t.bf16);
    PCCL_MPI(MPI_Op_create)(user_reduce<DType::F16, Op::Sum>, 1, &t.ops[0][0]);
    PCCL_MPI(MPI_Op_create)(user_reduce<DType::F16, Op::Max>, 1, &t.ops[0][1]);
    PCCL_MPI(MPI_Op_create)(user_reduce<DType::F16, Op::Min>, 1, &t.ops[0][2]);
    PCCL_MPI(MPI_Op_create)(user_reduce<DType::BF16, Op::Sum>, 1, &t.ops[1][0]);
    PCCL_MPI(MPI_Op_create)(user_reduce<DType::BF16, Op::Max>, 1, &t.ops[1][1]);
    PCCL_MPI(MPI_Op_create)(user_reduce<DType::BF16, Op::Min>, 1, &t.ops[1][2]);
  });
  return t;
}

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::F16: return half_types().f16;
    case DType::BF16: return half_types().bf16;
  }
  throw std::invalid_argument("unknown dtype code");
}

MPI_Op mpi_op(DType dtype, Op op) {
  const int index = op == Op::Max ? 1 : op == Op::Min ? 2 : 0;  // Avg reduces as Sum
  if (dtype == DType::F16 || dtype == DType::BF16) return half_types().ops[dtype == DType::BF16][index];
  return index == 1 ? MPI_MAX : index == 2 ? MPI_MIN : MPI_SUM;
}

Count mpi_count(int64_t count) {
  if (count > std::numeric_limits<Count>::max())
    throw std::length_error("pccl: the MPI library's collectives take at most " +
                            std::to_string(std::numeric_limits<Count>::max()) +
                            " elements per rank with this MPI (pre MPI-4); use a pccl algorithm");
  return static_cast<Count>(count);
}

}  // namespace

// The blocking call with the watchdog armed around it, or (polled) the nonblocking call,
// tested until done like a schedule's messages. A collective request can be neither
// cancelled nor freed (MPI 4.1, 3.8.4 and 6.12): on a timeout it is left pending, and the
// communicator is broken from then on.
void MpiComm::native(const char* what, DType dtype, Op op, bool polled, const NativeCall& call) {
  const MPI_Datatype type = mpi_type(dtype);
  const MPI_Op mop = mpi_op(dtype, op);
  if (!polled) {
    watchdog_.arm(what);
    const int err = call(type, mop, nullptr);
    watchdog_.disarm();
    check(err, what);
    return;
  }
  MPI_Request request = MPI_REQUEST_NULL;
  check(call(type, mop, &request), what);
  const bool done = poll([&] {
    int finished = 0;
    check(MPI_Test(&request, &finished, MPI_STATUS_IGNORE), "MPI_Test");
    return finished != 0;
  });
  if (!done) throw Timeout(timed_out(std::string("in ") + what));
}

// Runs `run(out, in)` on the buffers themselves, or, for GPU buffers that MPI cannot take
// (it is not GPU-aware), on pinned host copies.
void MpiComm::native_on(void* out, size_t out_bytes, const void* in, size_t in_bytes, const Memory& mem,
                        const std::function<void(void*, const void*)>& run) {
  if (!mem.staged) {
    mem.sync();
    run(out, in);
    return;
  }
  char* host_out = host_out_.get(out_bytes, mem, allocate_);
  char* host_in = in == out ? host_out : host_in_.get(in_bytes, mem, allocate_);
  mem.copy(host_in, in, in_bytes);
  mem.sync();
  run(host_out, host_in);
  mem.copy(out, host_out, out_bytes);
}

namespace {

bool is_half(DType dtype) { return dtype == DType::F16 || dtype == DType::BF16; }

// MPI's counts and displacements of a layout's blocks, one per rank.
struct Blocks {
  std::vector<Count> counts;
  std::vector<Displacement> at;
};
Blocks blocks_of(Layout layout, int size) {
  Blocks b{std::vector<Count>(size), std::vector<Displacement>(size)};
  for (int r = 0; r < size; ++r) {
    b.counts[r] = mpi_count(layout.offset(r + 1) - layout.offset(r));
    b.at[r] = mpi_count(layout.offset(r));
  }
  return b;
}

}  // namespace

// Every rank receives its block from all ranks (one MPI_Alltoallv, the traffic of a
// pairwise reduce-scatter) and reduces them on the device in rank order, the same order
// on every rank.
void MpiComm::alltoall_reduce(void* out, const void* in, Layout layout, DType dtype, Op op, const Memory& mem,
                              bool polled) {
  const size_t esize = elem_size(dtype);
  const int64_t mine = layout.offset(rank_ + 1) - layout.offset(rank_);
  char* gathered = gathered_.get(mine * size_ * esize, mem, allocate_);
  const Blocks send = blocks_of(layout, size_), recv = blocks_of(Layout(mine * size_, size_), size_);
  native_on(gathered, mine * size_ * esize, in, layout.offset(size_) * esize, mem, [&](void* o, const void* i) {
    native(polled ? "MPI_Ialltoallv" : "MPI_Alltoallv", dtype, Op::Sum, polled,
           [&](MPI_Datatype type, MPI_Op, MPI_Request* req) {
             return req ? PCCL_MPI(MPI_Ialltoallv)(i, send.counts.data(), send.at.data(), type, o,
                                                   recv.counts.data(), recv.at.data(), type, comm_, req)
                        : PCCL_MPI(MPI_Alltoallv)(i, send.counts.data(), send.at.data(), type, o,
                                                  recv.counts.data(), recv.at.data(), type, comm_);
           });
  });
  mem.copy(out, gathered, mine * esize);
  for (int r = 1; r < size_; ++r) mem.reduce(out, out, gathered + r * mine * esize, mine, dtype, op);
}

void MpiComm::native_all_gather(void* out, const void* in, int64_t count, DType dtype, const Memory& mem,
                                bool polled) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  mem.activate();
  const Count n = mpi_count(count);
  const size_t bytes = count * elem_size(dtype);
  auto run = [&](void* o, const void* i) {
    const bool in_place = static_cast<char*>(o) + rank_ * bytes == i;
    const void* send = in_place ? MPI_IN_PLACE : i;
    native(polled ? "MPI_Iallgather" : "MPI_Allgather", dtype, Op::Sum, polled,
           [&](MPI_Datatype type, MPI_Op, MPI_Request* req) {
             return req ? PCCL_MPI(MPI_Iallgather)(send, n, type, o, n, type, comm_, req)
                        : PCCL_MPI(MPI_Allgather)(send, n, type, o, n, type, comm_);
           });
  };
  native_on(out, bytes * size_, in, bytes, mem, run);
}

void MpiComm::native_reduce_scatter(void* out, const void* in, int64_t count, DType dtype, Op op,
                                    const Memory& mem, bool polled) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  mem.activate();
  const Count n = mpi_count(count);
  const size_t bytes = count * elem_size(dtype);
  auto run = [&](void* o, const void* i) {
    native(polled ? "MPI_Ireduce_scatter_block" : "MPI_Reduce_scatter_block", dtype, op, polled,
           [&](MPI_Datatype type, MPI_Op mop, MPI_Request* req) {
             return req ? PCCL_MPI(MPI_Ireduce_scatter_block)(i, o, n, type, mop, comm_, req)
                        : PCCL_MPI(MPI_Reduce_scatter_block)(i, o, n, type, mop, comm_);
           });
  };
  if (mem.gpu() && is_half(dtype))
    alltoall_reduce(out, in, Layout(count * size_, size_), dtype, op, mem, polled);
  else
    native_on(out, bytes, in, bytes * size_, mem, run);
  if (op == Op::Avg) mem.divide(out, count, dtype, size_);
}

void MpiComm::native_all_reduce(void* buf, int64_t count, DType dtype, Op op, const Memory& mem, bool polled) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  mem.activate();
  const size_t bytes = count * elem_size(dtype);
  if (mem.gpu() && is_half(dtype)) {
    // Reduce-scatter by MPI_Alltoallv and the device, then MPI_Allgatherv of the blocks.
    const Layout layout(count, size_);
    alltoall_reduce(static_cast<char*>(buf) + layout.offset(rank_) * elem_size(dtype), buf, layout, dtype, op, mem,
                    polled);
    const Blocks blocks = blocks_of(layout, size_);
    native_on(buf, bytes, buf, bytes, mem, [&](void* o, const void*) {
      native(polled ? "MPI_Iallgatherv" : "MPI_Allgatherv", dtype, Op::Sum, polled,
             [&](MPI_Datatype type, MPI_Op, MPI_Request* req) {
               return req ? PCCL_MPI(MPI_Iallgatherv)(MPI_IN_PLACE, 0, type, o, blocks.counts.data(),
                                                      blocks.at.data(), type, comm_, req)
                          : PCCL_MPI(MPI_Allgatherv)(MPI_IN_PLACE, 0, type, o, blocks.counts.data(),
                                                     blocks.at.data(), type, comm_);
             });
    });
  } else {
    const Count n = mpi_count(count);
    native_on(buf, bytes, buf, bytes, mem, [&](void* o, const void*) {
      native(polled ? "MPI_Iallreduce" : "MPI_Allreduce", dtype, op, polled,
             [&](MPI_Datatype type, MPI_Op mop, MPI_Request* req) {
               return req ? PCCL_MPI(MPI_Iallreduce)(MPI_IN_PLACE, o, n, type, mop, comm_, req)
                          : PCCL_MPI(MPI_Allreduce)(MPI_IN_PLACE, o, n, type, mop, comm_);
             });
    });
  }
  if (op == Op::Avg) mem.divide(buf, count, dtype, size_);
}

void MpiComm::native_broadcast(void* buf, int64_t count, DType dtype, int root, const Memory& mem, bool polled) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  mem.activate();
  const Count n = mpi_count(count);
  const size_t bytes = count * elem_size(dtype);
  native_on(buf, bytes, buf, bytes, mem, [&](void* o, const void*) {
    native(polled ? "MPI_Ibcast" : "MPI_Bcast", dtype, Op::Sum, polled,
           [&](MPI_Datatype type, MPI_Op, MPI_Request* req) {
             return req ? PCCL_MPI(MPI_Ibcast)(o, n, type, root, comm_, req)
                        : PCCL_MPI(MPI_Bcast)(o, n, type, root, comm_);
           });
  });
}

void MpiComm::native_barrier(bool polled) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  native(polled ? "MPI_Ibarrier" : "MPI_Barrier", DType::I32, Op::Sum, polled,
         [&](MPI_Datatype, MPI_Op, MPI_Request* req) {
           return req ? MPI_Ibarrier(comm_, req) : MPI_Barrier(comm_);   // no large-count form: no count
         });
}

}  // namespace pccl
