// The schedule executor: runs any pccl schedule with nonblocking point-to-point
// messages, one step at a time, on a private duplicate of the caller's communicator.
#include "comm.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "reduce.h"

namespace pccl {
namespace {

constexpr int kTag = 7001;
// MPI counts are int: larger messages travel as several messages of at most 1 GiB.
constexpr int64_t kMaxMessage = int64_t{1} << 30;

enum Kind : int64_t { kSend = 0, kRecv = 1, kRecvReduce = 2 };

MPI_Comm dup_comm(MPI_Comm comm) {
  MPI_Comm out;
  if (MPI_Comm_dup(comm, &out) != MPI_SUCCESS) throw std::runtime_error("pccl: MPI_Comm_dup failed");
  MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN);
  return out;
}

}  // namespace

MpiComm::MpiComm(MPI_Comm comm, double timeout_s, bool gpu_aware)
    : comm_(dup_comm(comm)), timeout_s_(timeout_s), gpu_aware_(gpu_aware), watchdog_(comm_, timeout_s) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

MpiComm::~MpiComm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL && !broken_) MPI_Comm_free(&comm_);
}

void MpiComm::set_timeout(double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  timeout_s_ = timeout_s;
  watchdog_.set_timeout(timeout_s);
}

void MpiComm::check(int err, const char* what) {
  if (err == MPI_SUCCESS) return;
  broken_ = true;  // requests may be in flight: the message state is unknown from here on
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(err, msg, &len);
  throw std::runtime_error(std::string("pccl: ") + what + " failed: " + std::string(msg, len));
}

void MpiComm::check_usable() const {
  if (broken_)
    throw std::runtime_error(
        "pccl: an earlier collective on this communicator timed out or failed and its message "
        "state is unknown; create a new communicator");
}

void MpiComm::post(bool is_send, char* ptr, int64_t bytes, int peer) {
  for (int64_t done = 0; done < bytes; done += kMaxMessage) {
    int n = static_cast<int>(std::min(kMaxMessage, bytes - done));
    MPI_Request req;
    int err = is_send ? MPI_Isend(ptr + done, n, MPI_BYTE, peer, kTag, comm_, &req)
                      : MPI_Irecv(ptr + done, n, MPI_BYTE, peer, kTag, comm_, &req);
    check(err, is_send ? "MPI_Isend" : "MPI_Irecv");
    reqs_.push_back(req);
    req_peers_.push_back(peer);
  }
}

// Polls instead of blocking so that a missing peer becomes a Timeout, and yields the
// core between polls so oversubscribed ranks (several per core) still make progress.
void MpiComm::wait_all(int64_t step) {
  if (reqs_.empty()) return;
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s_);
  for (uint64_t polls = 0;; ++polls) {
    int done = 0;
    check(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &done, MPI_STATUSES_IGNORE),
          "MPI_Testall");
    if (done) break;
    if (polls % 256 == 255 && clock::now() > deadline) {
      std::string peers;
      for (size_t i = 0; i < reqs_.size(); ++i) {
        if (reqs_[i] == MPI_REQUEST_NULL) continue;
        if (peers.find(" " + std::to_string(req_peers_[i]) + ",") == std::string::npos)
          peers += " " + std::to_string(req_peers_[i]) + ",";
        MPI_Cancel(&reqs_[i]);
        MPI_Request_free(&reqs_[i]);
      }
      reqs_.clear();
      req_peers_.clear();
      broken_ = true;
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%g", timeout_s_);
      throw Timeout("pccl: rank " + std::to_string(rank_) + " timed out after " + seconds + " s at step " +
                    std::to_string(step) + " waiting for peers" + peers.substr(0, peers.size() - 1) +
                    " (did every rank call the same collective?)");
    }
    sched_yield();
  }
  reqs_.clear();
  req_peers_.clear();
}

// Where the current values of blocks [first, first+count) are: in source while none was
// touched, in buf once all were; a mixed run is completed in buf first.
const char* MpiComm::current(char* buf, const char* source, Layout layout, size_t esize, int64_t first,
                             int64_t count, const Memory& mem) {
  const int64_t offset = layout.offset(first) * esize;
  if (source == nullptr) return buf + offset;
  int64_t fresh = 0;
  for (int64_t b = first; b < first + count; ++b) fresh += touched_[b];
  if (fresh == 0) return source + offset;
  for (int64_t b = first; b < first + count; ++b) {
    if (touched_[b]) continue;
    const int64_t at = layout.offset(b) * esize;
    mem.copy(buf + at, source + at, (layout.offset(b + 1) - layout.offset(b)) * esize);
    touched_[b] = 1;
  }
  return buf + offset;
}

// One step at a time: receives are posted first, then sends; when all completed, the
// received blocks are reduced (or, staged, copied) into place. On a GPU, local work is
// queued on the caller's stream and the stream is waited for before MPI reads buffers.
void MpiComm::execute(const int64_t* ops, int64_t rows, char* buf, Layout layout, DType dtype, Op op,
                      const Memory& mem, const char* source) {
  const size_t esize = elem_size(dtype);
  const Memory host;
  auto bytes_of = [&](const int64_t* row) {
    return (layout.offset(row[3] + row[4]) - layout.offset(row[3])) * static_cast<int64_t>(esize);
  };
  for (int64_t begin = 0; begin < rows;) {
    const int64_t step = ops[begin * 5];
    int64_t end = begin;
    size_t scratch_bytes = 0, stage_bytes = 0;
    for (; end < rows && ops[end * 5] == step; ++end) {
      const int64_t* row = ops + end * 5;
      if (row[1] == kRecvReduce) scratch_bytes += bytes_of(row);
      if (mem.staged) stage_bytes += bytes_of(row);
    }
    char* scratch = scratch_.get(scratch_bytes, mem);
    char* stage = stage_.get(stage_bytes, host);
    // Where each send reads from, decided (and, staged, copied to host memory) before
    // the stream is waited for, so no queued copy races with MPI.
    send_from_.clear();
    for (int64_t i = begin, at = 0; i < end; ++i) {
      const int64_t* row = ops + i * 5;
      if (row[1] == kSend) {
        const char* from = current(buf, source, layout, esize, row[3], row[4], mem);
        if (mem.staged) mem.copy(stage + at, from, bytes_of(row));
        send_from_.push_back(mem.staged ? stage + at : from);
      }
      at += mem.staged ? bytes_of(row) : 0;
    }
    mem.sync();  // GPU: the previous step's reductions and copies are done before MPI reads
    reductions_.clear();
    landed_.clear();
    char* slot = stage;
    size_t sends = 0;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* row = ops + i * 5;
      const int peer = static_cast<int>(row[2]);
      const int64_t first = row[3], count = row[4], bytes = bytes_of(row);
      char* staged = slot;
      slot += mem.staged ? bytes : 0;
      if (row[1] == kSend) {
        const char* from = send_from_[sends++];
        if (bytes > 0) post(true, const_cast<char*>(from), bytes, peer);
        continue;
      }
      if (bytes == 0) continue;  // empty blocks (count < size): neither side sends
      char* target = buf + layout.offset(first) * esize;
      landed_.emplace_back(first, count);
      const bool reduce = row[1] == kRecvReduce;
      char* landing = reduce ? scratch : target;
      if (reduce) scratch += bytes;
      post(false, mem.staged ? staged : landing, bytes, peer);
      if (reduce || mem.staged)
        reductions_.push_back({target, reduce ? current(buf, source, layout, esize, first, count, mem) : nullptr,
                               mem.staged ? staged : nullptr, landing, bytes, reduce});
    }
    wait_all(step);
    for (const Pending& r : reductions_) {
      if (r.staged != nullptr) mem.copy(r.landing, r.staged, r.bytes);
      if (r.reduce) mem.reduce(r.dst, r.a, r.landing, r.bytes / static_cast<int64_t>(esize), dtype, op);
    }
    if (source != nullptr)
      for (auto [first, count] : landed_) std::fill(touched_.begin() + first, touched_.begin() + first + count, 1);
    begin = end;
  }
}

void MpiComm::all_gather(const int64_t* ops, int64_t rows, void* out, const void* in, int64_t count,
                         DType dtype, const Memory& mem) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  mem.activate();
  const size_t bytes = count * elem_size(dtype);
  char* mine = static_cast<char*>(out) + rank_ * bytes;
  if (mine != in) mem.copy(mine, in, bytes);
  execute(ops, rows, static_cast<char*>(out), Layout(count * size_, size_), dtype, Op::Sum, mem);
}

void MpiComm::reduce_scatter(const int64_t* ops, int64_t rows, void* out, const void* in, int64_t count,
                             DType dtype, Op op, const Memory& mem) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  mem.activate();
  const size_t bytes = count * elem_size(dtype);
  // The input stays untouched: partial results go to a cached work buffer, filled lazily.
  char* work = work_.get(bytes * size_, mem);
  touched_.assign(size_, 0);
  const char* source = static_cast<const char*>(in);
  execute(ops, rows, work, Layout(count * size_, size_), dtype, op, mem, source);
  mem.copy(out, (touched_[rank_] ? work : source) + rank_ * bytes, bytes);
  if (op == Op::Avg) mem.scale(out, count, dtype, 1.0 / size_);
}

void MpiComm::all_reduce(const int64_t* ops, int64_t rows, void* buf, int64_t count, DType dtype, Op op,
                         const Memory& mem) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  mem.activate();
  execute(ops, rows, static_cast<char*>(buf), Layout(count, size_), dtype, op, mem);
  if (op == Op::Avg) mem.scale(buf, count, dtype, 1.0 / size_);
}

}  // namespace pccl
