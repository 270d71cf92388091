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

MpiComm::MpiComm(MPI_Comm comm, double timeout_s)
    : comm_(dup_comm(comm)), timeout_s_(timeout_s), watchdog_(comm_, timeout_s) {
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

char* MpiComm::workspace(std::vector<char>& space, size_t bytes) {
  if (space.size() < bytes) space.resize(bytes);
  return space.data();
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
                             int64_t count) {
  const int64_t offset = layout.offset(first) * esize;
  if (source == nullptr) return buf + offset;
  int64_t fresh = 0;
  for (int64_t b = first; b < first + count; ++b) fresh += touched_[b];
  if (fresh == 0) return source + offset;
  for (int64_t b = first; b < first + count; ++b) {
    if (touched_[b]) continue;
    const int64_t at = layout.offset(b) * esize;
    std::memcpy(buf + at, source + at, (layout.offset(b + 1) - layout.offset(b)) * esize);
    touched_[b] = 1;
  }
  return buf + offset;
}

void MpiComm::execute(const int64_t* ops, int64_t rows, char* buf, Layout layout, DType dtype, Op op,
                      const char* source) {
  const size_t esize = elem_size(dtype);
  auto bytes_of = [&](int64_t first, int64_t count) {
    return (layout.offset(first + count) - layout.offset(first)) * static_cast<int64_t>(esize);
  };
  for (int64_t begin = 0; begin < rows;) {
    const int64_t step = ops[begin * 5];
    int64_t end = begin;
    size_t scratch_bytes = 0;
    for (; end < rows && ops[end * 5] == step; ++end)
      if (ops[end * 5 + 1] == kRecvReduce) scratch_bytes += bytes_of(ops[end * 5 + 3], ops[end * 5 + 4]);
    char* scratch = workspace(scratch_, scratch_bytes);
    reductions_.clear();
    landed_.clear();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* row = ops + i * 5;
      const int peer = static_cast<int>(row[2]);
      const int64_t first = row[3], count = row[4];
      const int64_t bytes = bytes_of(first, count);
      if (bytes == 0) continue;  // empty blocks (count < size): neither side sends
      char* target = buf + layout.offset(first) * esize;
      if (row[1] == kSend) {
        post(true, const_cast<char*>(current(buf, source, layout, esize, first, count)), bytes, peer);
        continue;
      }
      landed_.emplace_back(first, count);
      if (row[1] == kRecv) {
        post(false, target, bytes, peer);
      } else {
        post(false, scratch, bytes, peer);
        reductions_.push_back({target, current(buf, source, layout, esize, first, count), scratch,
                               bytes / static_cast<int64_t>(esize)});
        scratch += bytes;
      }
    }
    wait_all(step);
    for (const Pending& r : reductions_) reduce(r.dst, r.a, r.b, r.elems, dtype, op);
    if (source != nullptr)
      for (auto [first, count] : landed_) std::fill(touched_.begin() + first, touched_.begin() + first + count, 1);
    begin = end;
  }
}

void MpiComm::all_gather(const int64_t* ops, int64_t rows, void* out, const void* in, int64_t count,
                         DType dtype) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  const size_t bytes = count * elem_size(dtype);
  char* mine = static_cast<char*>(out) + rank_ * bytes;
  if (mine != in) std::memcpy(mine, in, bytes);
  execute(ops, rows, static_cast<char*>(out), Layout(count * size_, size_), dtype, Op::Sum);
}

void MpiComm::reduce_scatter(const int64_t* ops, int64_t rows, void* out, const void* in, int64_t count,
                             DType dtype, Op op) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  const size_t bytes = count * elem_size(dtype);
  // The input stays untouched: partial results go to a cached work buffer, filled lazily.
  char* work = workspace(work_, bytes * size_);
  touched_.assign(size_, 0);
  const char* source = static_cast<const char*>(in);
  execute(ops, rows, work, Layout(count * size_, size_), dtype, op, source);
  std::memcpy(out, (touched_[rank_] ? work : source) + rank_ * bytes, bytes);
  if (op == Op::Avg) scale(out, count, dtype, 1.0 / size_);
}

void MpiComm::all_reduce(const int64_t* ops, int64_t rows, void* buf, int64_t count, DType dtype, Op op) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  execute(ops, rows, static_cast<char*>(buf), Layout(count, size_), dtype, op);
  if (op == Op::Avg) scale(buf, count, dtype, 1.0 / size_);
}

}  // namespace pccl
