// A watchdog for calls that cannot be interrupted (the MPI library's own blocking
// collectives): if one is still running after the timeout, it reports what was stuck
// and aborts the job, as a vendor library's watchdog does, instead of hanging forever.
#pragma once
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

namespace pccl {

class Watchdog {
 public:
  static constexpr int kReportGraceMs = 500;

  Watchdog(MPI_Comm comm, double timeout_s) : comm_(comm), timeout_s_(timeout_s) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void set_timeout(double timeout_s) { timeout_s_ = timeout_s; }

  // Cheap: two atomic stores. The thread starts on first use.
  void arm(const char* what) {
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    what_.store(what);
    since_ns_.store(now_ns());
  }
  void disarm() { since_ns_.store(0); }

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      double period = std::min(1.0, std::max(0.01, timeout_s_.load() / 8));
      cv_.wait_for(lock, std::chrono::duration<double>(period));
      int64_t since = since_ns_.load();
      if (!stop_ && since != 0 && (now_ns() - since) * 1e-9 > timeout_s_.load()) {
        int rank = -1;
        MPI_Comm_rank(comm_, &rank);
        std::fprintf(stderr,
                     "pccl: rank %d: %s did not complete within the timeout of %.1f s; a peer "
                     "never arrived. Aborting the job (MPI's blocking collectives cannot be "
                     "cancelled).\n", rank, what_.load(), timeout_s_.load());
        std::fflush(stderr);
        // The launcher forwards this rank's stderr and handles the abort on two channels, and
        // may end the job before it has read the message (mpiexec lost it in 2 of 200 aborts):
        // a moment for it to pass the reason on, after a wait of the whole timeout.
        std::this_thread::sleep_for(std::chrono::milliseconds(kReportGraceMs));
        MPI_Abort(MPI_COMM_WORLD, 124);   // the job: comm_ may be a sub-communicator (a plan level)
      }
    }
  }

  MPI_Comm comm_;
  std::atomic<double> timeout_s_;
  std::atomic<int64_t> since_ns_{0};
  std::atomic<const char*> what_{""};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace pccl
