// The schedule executor: runs any pccl schedule with nonblocking point-to-point
// messages, one step at a time, on a private duplicate of the caller's communicator.
#include "comm.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "reduce.h"
#ifdef PCCL_GPU
#include "gpu/gpu.h"
#endif

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

// The rows of one step: [begin, end).
int64_t step_end(const int64_t* ops, int64_t rows, int64_t begin) {
  int64_t end = begin;
  while (end < rows && ops[end * 5] == ops[begin * 5]) ++end;
  return end;
}

}  // namespace

MpiComm::MpiComm(MPI_Comm comm, double timeout_s, bool gpu_aware, Allocator allocate, bool emulate_gpu)
    : comm_(dup_comm(comm)),
      timeout_s_(timeout_s),
      gpu_aware_(gpu_aware),
      allocate_(std::move(allocate)),
      emulate_gpu_(emulate_gpu),
      watchdog_(comm_, timeout_s) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  // Translated once, so that a timeout's message names the peers as the launcher numbers them.
  MPI_Group mine, world;
  MPI_Comm_group(comm_, &mine);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> ranks(size_);
  for (int r = 0; r < size_; ++r) ranks[r] = r;
  world_ranks_.resize(size_);
  MPI_Group_translate_ranks(mine, size_, ranks.data(), world, world_ranks_.data());
  MPI_Group_free(&mine);
  MPI_Group_free(&world);
}

MpiComm::~MpiComm() {
#ifdef PCCL_GPU
  for (void* event : events_) gpu::event_destroy(event);
#endif
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

void MpiComm::failed_requests(int err) {
  // A message longer than its receive is the usual cause: the ranks called the collective
  // with different sizes or dtypes. Name it, and the peer, rather than MPI's "see the
  // MPI_ERROR field" of MPI_ERR_IN_STATUS.
  if (err == MPI_ERR_IN_STATUS) {
    for (size_t i = 0; i < statuses_.size(); ++i) {
      const int e = statuses_[i].MPI_ERROR;
      if (e == MPI_SUCCESS || e == MPI_ERR_PENDING) continue;
      int cls = 0;
      MPI_Error_class(e, &cls);
      const int peer = req_peers_[i];
      const std::string who = "rank " + std::to_string(peer) +
                              (world_ranks_[peer] == peer ? "" : " (world rank " + std::to_string(world_ranks_[peer]) + ")");
      if (cls == MPI_ERR_TRUNCATE) {
        broken_ = true;
        throw std::runtime_error("pccl: a message from " + who +
                                 " was longer than its receive (MPI_ERR_TRUNCATE): the ranks called this collective "
                                 "with different sizes or dtypes (PCCL_CHECK_CALLS=1 names the difference on every rank, "
                                 "before anything is sent)");
      }
      check(e, req_sends_[i] ? "a send (MPI_Testall)" : "a receive (MPI_Testall)");
    }
  }
  check(err, "MPI_Testall");
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
    req_sends_.push_back(is_send);
  }
}

// The peers of the requests still pending, as "receive from 1, 3; send to 2", each with
// its world rank where that differs (a sub-communicator's ranks are not the launcher's).
std::string MpiComm::waited_peers() const {
  std::string out;
  for (int send = 0; send < 2; ++send) {
    std::vector<int> peers;
    for (size_t i = 0; i < reqs_.size(); ++i)
      if (reqs_[i] != MPI_REQUEST_NULL && req_sends_[i] == send &&
          std::find(peers.begin(), peers.end(), req_peers_[i]) == peers.end())
        peers.push_back(req_peers_[i]);
    if (peers.empty()) continue;
    out += out.empty() ? "" : "; ";
    out += send ? "send to " : "receive from ";
    for (size_t i = 0; i < peers.size(); ++i) {
      out += (i ? ", " : "") + std::to_string(peers[i]);
      const int w = world_ranks_[peers[i]];
      if (w != peers[i]) out += " (world rank " + std::to_string(w) + ")";
    }
  }
  return out;
}

// Polls `test` until it reports done, false once the timeout has passed. MPI moves a
// message between ranks of one node (shared memory) and advances a nonblocking collective
// (MPICH) only inside our MPI calls, so a waiting rank yields the core between polls, as
// MPI's blocking calls do, instead of napping: with 100 us naps after 50 us the engine's
// lanes ran 0.78x as fast as MPI's blocking collectives on 4 ranks of 2 cores (shard-compare,
// zero3-pccl against zero3-native), and 1.0x spinning; emulated 1 Gbit nodes lost nothing.
// Only a wait past kSpin (a straggler, not a transfer) naps, doubling from 1 us to kMaxNap,
// and leaves the core to the threads that compute.
bool MpiComm::poll(const std::function<bool()>& test) const {
  using clock = std::chrono::steady_clock;
  constexpr auto kSpin = std::chrono::milliseconds(100);
  constexpr auto kMaxNap = std::chrono::microseconds(100);
  const auto start = clock::now();
  const auto deadline = start + std::chrono::duration<double>(timeout_s_);
  auto nap = std::chrono::microseconds(1);
  for (;;) {
    if (test()) return true;
    const auto now = clock::now();
    if (now > deadline) return false;
    if (now - start < kSpin) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, kMaxNap);
    }
  }
}

std::string MpiComm::timed_out(const std::string& what) {
  broken_ = true;
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%g", timeout_s_);
  // a plan level's rank names its world rank too, as waited_peers names the peers'
  const std::string world =
      world_ranks_[rank_] == rank_ ? "" : " (world rank " + std::to_string(world_ranks_[rank_]) + ")";
  return "pccl: rank " + std::to_string(rank_) + world + " timed out after " + seconds + " s " + what +
         " (a peer died, or did not call the same collective)";
}

// Polls the step's messages, so that a missing peer becomes a Timeout naming them.
void MpiComm::wait_all(int64_t step) {
  if (reqs_.empty()) return;
  statuses_.resize(reqs_.size());
  const bool done = poll([this] {
    int all = 0;
    const int err = MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &all, statuses_.data());
    if (err != MPI_SUCCESS) failed_requests(err);
    return all != 0;
  });
  if (!done) {
    const std::string peers = waited_peers();
    for (auto& req : reqs_) {
      if (req == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&req);
      MPI_Request_free(&req);
    }
    reqs_.clear();
    req_peers_.clear();
    req_sends_.clear();
    throw Timeout(timed_out("at step " + std::to_string(step) + " waiting to " + peers));
  }
  reqs_.clear();
  req_peers_.clear();
  req_sends_.clear();
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
// received blocks are reduced into place. On a GPU (GPU-aware MPI), local work is queued
// on the caller's stream and the stream is waited for before MPI reads buffers.
void MpiComm::execute(const int64_t* ops, int64_t rows, char* buf, Layout layout, DType dtype, Op op,
                      const Memory& mem, const char* source) {
  if (mem.staged) return execute_staged(ops, rows, buf, layout, dtype, op, mem, source);
  const size_t esize = elem_size(dtype);
  auto bytes_of = [&](const int64_t* row) {
    return (layout.offset(row[3] + row[4]) - layout.offset(row[3])) * static_cast<int64_t>(esize);
  };
  for (int64_t begin = 0, end; begin < rows; begin = end) {
    const int64_t step = ops[begin * 5];
    end = step_end(ops, rows, begin);
    size_t scratch_bytes = 0;
    for (int64_t i = begin; i < end; ++i)
      if (ops[i * 5 + 1] == kRecvReduce) scratch_bytes += bytes_of(ops + i * 5);
    char* scratch = scratch_.get(scratch_bytes, mem, allocate_);
    // Where each send reads from, decided before the stream is waited for, so no queued
    // copy races with MPI.
    send_from_.clear();
    for (int64_t i = begin; i < end; ++i)
      if (ops[i * 5 + 1] == kSend) send_from_.push_back(current(buf, source, layout, esize, ops[i * 5 + 3], ops[i * 5 + 4], mem));
    mem.sync();  // GPU: the previous step's reductions and copies are done before MPI reads
    pending_.clear();
    size_t sends = 0;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* row = ops + i * 5;
      const int peer = static_cast<int>(row[2]);
      const int64_t first = row[3], count = row[4], bytes = bytes_of(row);
      if (row[1] == kSend) {
        const char* from = send_from_[sends++];
        if (bytes > 0) post(true, const_cast<char*>(from), bytes, peer);
        continue;
      }
      if (bytes == 0) continue;  // empty blocks (count < size): neither side sends
      char* target = buf + layout.offset(first) * esize;
      if (row[1] == kRecvReduce) {
        pending_.push_back({first, count, target, current(buf, source, layout, esize, first, count, mem), scratch, true});
        post(false, scratch, bytes, peer);
        scratch += bytes;
      } else {
        pending_.push_back({first, count, target, nullptr, nullptr, false});
        post(false, target, bytes, peer);
      }
    }
    wait_all(step);
    for (const Pending& r : pending_) {
      const int64_t n = layout.offset(r.first + r.count) - layout.offset(r.first);
      if (r.reduce) mem.reduce(r.dst, r.a, r.landing, n, dtype, op);
    }
    mark_touched(source);
  }
}

void MpiComm::mark_touched(const char* source) {
  if (source == nullptr) return;
  for (const Pending& r : pending_) std::fill(touched_.begin() + r.first, touched_.begin() + r.first + r.count, 1);
}

// Staged: MPI reads and writes a pinned host mirror of the buffer; the device buffer holds
// every block's value in stream order. A block's mirror is current once copied there for a
// send or received there (host_ok_), stale once reduced on the device. So a block received
// in one step and forwarded in the next (all-gather) is sent from the mirror without a
// copy or a wait. The copies of a step's receives to the device are queued and not waited
// for: they overlap the next step's messages, the double buffering. The CPU waits on a
// fence (an event) only where MPI needs data from the device (a send of a block computed
// there), where a receive would overwrite host memory a queued copy still reads (reduce
// landings alternate between two buffers, so that is the step before last), and once at
// the end, before the host buffers can be reused.
void MpiComm::execute_staged(const int64_t* ops, int64_t rows, char* buf, Layout layout, DType dtype, Op op,
                             const Memory& mem, const char* source) {
  const size_t esize = elem_size(dtype);
  auto bytes_of = [&](int64_t first, int64_t count) {
    return (layout.offset(first + count) - layout.offset(first)) * static_cast<int64_t>(esize);
  };
  int64_t landing_bytes = 0;  // the most any step receives to reduce
  for (int64_t begin = 0, end; begin < rows; begin = end) {
    end = step_end(ops, rows, begin);
    int64_t step_bytes = 0;
    for (int64_t i = begin; i < end; ++i)
      if (ops[i * 5 + 1] == kRecvReduce) step_bytes += bytes_of(ops[i * 5 + 3], ops[i * 5 + 4]);
    landing_bytes = std::max(landing_bytes, step_bytes);
  }
  char* mirror = mirror_.get(layout.offset(size_) * esize, mem, allocate_);
  char* host_landings = landing_.get(2 * landing_bytes, mem, allocate_);
  char* device_landing = scratch_.get(landing_bytes, mem, allocate_);
  host_ok_.assign(size_, 0);
  host_reader_.assign(size_, 0);
  uint64_t landing_reader[2] = {0, 0};
  Fences fences(mem, events_);
  for (int64_t begin = 0, end, parity = 0; begin < rows; begin = end, parity ^= 1) {
    const int64_t step = ops[begin * 5];
    end = step_end(ops, rows, begin);
    // Sends read the mirror: bring the blocks whose value is only on the device.
    bool copied = false;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* row = ops + i * 5;
      if (row[1] != kSend) continue;
      for (int64_t b = row[3]; b < row[3] + row[4]; ++b) {
        if (host_ok_[b]) continue;
        const int64_t at = layout.offset(b) * esize;
        mem.copy(mirror + at, current(buf, source, layout, esize, b, 1, mem), bytes_of(b, 1));
        host_ok_[b] = copied = true;
      }
    }
    if (copied) fences.wait(fences.record());
    char* landing = host_landings + parity * landing_bytes;
    fences.wait(landing_reader[parity]);
    pending_.clear();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* row = ops + i * 5;
      const int peer = static_cast<int>(row[2]);
      const int64_t first = row[3], count = row[4], bytes = bytes_of(first, count);
      char* in_mirror = mirror + layout.offset(first) * esize;
      if (bytes == 0) continue;
      if (row[1] == kSend) {
        post(true, in_mirror, bytes, peer);
        continue;
      }
      char* target = buf + layout.offset(first) * esize;
      if (row[1] == kRecvReduce) {
        pending_.push_back({first, count, target, current(buf, source, layout, esize, first, count, mem), landing, true});
        post(false, landing, bytes, peer);
        landing += bytes;
      } else {
        for (int64_t b = first; b < first + count; ++b) fences.wait(host_reader_[b]);
        pending_.push_back({first, count, target, nullptr, in_mirror, false});
        post(false, in_mirror, bytes, peer);
      }
    }
    wait_all(step);
    // The device side of the receives, queued; the next step's messages do not wait for it.
    char* on_device = device_landing;
    for (const Pending& r : pending_) {
      const int64_t bytes = bytes_of(r.first, r.count);
      if (r.reduce) {
        mem.copy(on_device, r.landing, bytes);
        mem.reduce(r.dst, r.a, on_device, bytes / static_cast<int64_t>(esize), dtype, op);
        on_device += bytes;
      } else {
        mem.copy(r.dst, r.landing, bytes);
      }
    }
    const uint64_t copied_in = fences.record();
    for (const Pending& r : pending_) {
      for (int64_t b = r.first; b < r.first + r.count; ++b) {
        host_ok_[b] = !r.reduce;
        if (!r.reduce) host_reader_[b] = copied_in;
      }
      if (r.reduce) landing_reader[parity] = copied_in;
    }
    mark_touched(source);
  }
  fences.wait(fences.record());  // the host buffers are free for the next call
}

// Blocks travel as their encodings (pccl.ir.compressed says what each step encodes,
// forwards, keeps, thaws and decodes). Each block's encoding has a home in one workspace,
// the blocks' encodings back to back, so a run of blocks is one contiguous message and a
// kept encoding lands in its home, to be forwarded from there. Decode-and-reduce landings
// go to scratch (a step may send a block's encoding and receive its partner's sum). The
// next step's encodings of blocks this step's messages leave alone are computed while the
// messages are in flight.
void MpiComm::execute_compressed(const int64_t* ops, int64_t rows, char* buf, Layout layout, DType dtype, Op op,
                                 const Codec& codec) {
  enum Action : int64_t { kSendEnc = 0, kKeep, kReduce, kEncode, kThaw, kUnpack, kFinish };
  const size_t esize = elem_size(dtype);
  const int decode_op = static_cast<int>(op == Op::Avg ? Op::Sum : op);
  encoded_at_.resize(size_ + 1);
  encoded_at_[0] = 0;
  for (int b = 0; b < size_; ++b)
    encoded_at_[b + 1] = encoded_at_[b] + codec.bytes(layout.offset(b + 1) - layout.offset(b));
  const Memory host;  // compressed schedules run on host buffers
  char* home = encodings_.get(encoded_at_[size_], host, allocate_);
  auto values = [&](int64_t b) { return buf + layout.offset(b) * esize; };
  auto numel = [&](int64_t b) { return layout.offset(b + 1) - layout.offset(b); };
  auto enc_bytes = [&](const int64_t* row) { return encoded_at_[row[3] + row[4]] - encoded_at_[row[3]]; };
  auto encode = [&](int64_t b) {
    if (numel(b) > 0) codec.encode(home + encoded_at_[b], values(b), numel(b), dtype);
  };
  busy_.assign(size_, 0);
  early_.assign(size_, 0);
  for (int64_t begin = 0, end; begin < rows; begin = end) {
    const int64_t step = ops[begin * 5];
    end = step_end(ops, rows, begin);
    int64_t scratch_bytes = 0;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* row = ops + i * 5;
      if (row[1] == kReduce) scratch_bytes += enc_bytes(row);
      if (row[1] == kEncode && !early_[row[3]]) encode(row[3]);
      if (row[1] != kEncode && row[1] != kFinish)
        std::fill(busy_.begin() + row[3], busy_.begin() + row[3] + row[4], 1);
    }
    std::fill(early_.begin(), early_.end(), 0);
    char* scratch = scratch_.get(scratch_bytes, host, allocate_);
    pending_.clear();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* row = ops + i * 5;
      const int64_t bytes = enc_bytes(row);
      char* encoding = home + encoded_at_[row[3]];
      if (row[1] == kSendEnc || row[1] == kKeep || row[1] == kUnpack) {
        if (row[1] == kUnpack) pending_.push_back({row[3], row[4], nullptr, nullptr, encoding, false});
        if (bytes > 0) post(row[1] == kSendEnc, encoding, bytes, static_cast<int>(row[2]));
      } else if (row[1] == kReduce) {
        pending_.push_back({row[3], row[4], nullptr, nullptr, scratch, true});
        if (bytes > 0) post(false, scratch, bytes, static_cast<int>(row[2]));
        scratch += bytes;
      }
    }
    // Overlap: encode ahead what the next step encodes, where this step leaves it alone.
    const int64_t next_end = end < rows ? step_end(ops, rows, end) : end;
    for (int64_t i = end; i < next_end; ++i) {
      const int64_t* row = ops + i * 5;
      if (row[1] == kEncode && !busy_[row[3]]) {
        encode(row[3]);
        early_[row[3]] = 1;
      }
    }
    wait_all(step);
    std::fill(busy_.begin(), busy_.end(), 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* row = ops + i * 5;
      if ((row[1] == kThaw || row[1] == kFinish) && numel(row[3]) > 0)
        codec.decode(values(row[3]), home + encoded_at_[row[3]], numel(row[3]), dtype, -1);
    }
    for (const Pending& r : pending_) {  // decoded on arrival: overwrite (per message) or reduce
      const char* at = r.landing;
      for (int64_t b = r.first; b < r.first + r.count; ++b) {
        if (numel(b) > 0) codec.decode(values(b), at, numel(b), dtype, r.reduce ? decode_op : -1);
        at += encoded_at_[b + 1] - encoded_at_[b];
      }
    }
  }
}

// Dispatches a schedule: compressed (host buffers), or plain.
void MpiComm::run(const int64_t* ops, int64_t rows, char* buf, Layout layout, DType dtype, Op op, const Memory& mem,
                  const Codec* codec, const char* source) {
  if (codec == nullptr) return execute(ops, rows, buf, layout, dtype, op, mem, source);
  if (mem.gpu()) throw std::invalid_argument("pccl: compressed schedules run on host buffers only");
  execute_compressed(ops, rows, buf, layout, dtype, op, *codec);
}

void MpiComm::all_gather(const int64_t* ops, int64_t rows, void* out, const void* in, int64_t count,
                         DType dtype, const Memory& mem, const Codec* codec) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  mem.activate();
  const size_t bytes = count * elem_size(dtype);
  char* mine = static_cast<char*>(out) + rank_ * bytes;
  if (mine != in) mem.copy(mine, in, bytes);
  run(ops, rows, static_cast<char*>(out), Layout(count * size_, size_), dtype, Op::Sum, mem, codec);
}

void MpiComm::reduce_scatter(const int64_t* ops, int64_t rows, void* out, const void* in, int64_t count,
                             DType dtype, Op op, const Memory& mem, const Codec* codec) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  mem.activate();
  const size_t bytes = count * elem_size(dtype);
  // The input stays untouched: partial results go to a cached work buffer, filled lazily
  // (compressed: whole, as blocks are encoded from it).
  char* work = work_.get(bytes * size_, mem, allocate_);
  const char* source = static_cast<const char*>(in);
  touched_.assign(size_, codec != nullptr);
  if (codec != nullptr) mem.copy(work, source, bytes * size_);
  run(ops, rows, work, Layout(count * size_, size_), dtype, op, mem, codec, codec ? nullptr : source);
  mem.copy(out, (touched_[rank_] ? work : source) + rank_ * bytes, bytes);
  if (op == Op::Avg) mem.divide(out, count, dtype, size_);
}

void MpiComm::all_reduce(const int64_t* ops, int64_t rows, void* buf, int64_t count, DType dtype, Op op,
                         const Memory& mem, const Codec* codec) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  mem.activate();
  run(ops, rows, static_cast<char*>(buf), Layout(count, size_), dtype, op, mem, codec);
  if (op == Op::Avg) mem.divide(buf, count, dtype, size_);
}

}  // namespace pccl
