// A watchdog for calls that cannot be interrupted (the MPI library's own blocking
// collectives): if one is still running after the timeout, it reports what was stuck
// and aborts the job, as a vendor library's watchdog does, instead of hanging forever.
#pragma once
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace pccl {

class Watchdog {
 public:
  static constexpr int kReportGraceMs = 500;
  static constexpr double kAbortFallbackS = 10.0;

  // The rank is read here, on the caller's thread: MPI calls from the watchdog's thread may
  // wait for the lock the stuck call holds.
  Watchdog(MPI_Comm comm, double timeout_s) : timeout_s_(timeout_s) { MPI_Comm_rank(comm, &rank_); }
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
        std::fprintf(stderr,
                     "pccl: rank %d: %s did not complete within the timeout of %.1f s; a peer "
                     "never arrived. Aborting the job (MPI's blocking collectives cannot be "
                     "cancelled).\n", rank_, what_.load(), timeout_s_.load());
        std::fflush(stderr);
        // The launcher forwards this rank's stderr and handles the abort on two channels, and
        // may end the job before it has read the message (mpiexec lost it in 2 of 200 aborts):
        // a moment for it to pass the reason on, after a wait of the whole timeout.
        std::this_thread::sleep_for(std::chrono::milliseconds(kReportGraceMs));
        // MPICH's MPI_Abort first takes the library's global lock, which the stuck call holds
        // and only yields now and then (its abort.c notes that Abort can hang so): where the
        // job has not ended after kAbortFallbackS, this process ends itself, and the launcher
        // (mpiexec; srun with --kill-on-bad-exit, as launch/*.sbatch run it) ends the others.
        std::thread([rank = rank_] {
          std::this_thread::sleep_for(std::chrono::duration<double>(kAbortFallbackS));
          std::fprintf(stderr, "pccl: rank %d: MPI_Abort did not end the job within %.0f s; "
                       "ending this process.\n", rank, kAbortFallbackS);
          std::fflush(stderr);
          std::_Exit(124);
        }).detach();
        MPI_Abort(MPI_COMM_WORLD, 124);   // the job: the call's may be a sub-communicator (a plan level)
      }
    }
  }

  int rank_ = -1;   // in the communicator of the call watched
  std::atomic<double> timeout_s_;
  std::atomic<int64_t> since_ns_{0};
  std::atomic<const char*> what_{""};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace pccl
