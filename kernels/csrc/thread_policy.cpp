// Moves the calling thread's compute threads (itself and the OpenMP workers its parallel regions
// run on: the pool torch's CPU ops and at::parallel_for use from that thread) to Linux's
// SCHED_IDLE policy, so that any other process's runnable thread on a core goes first. For a
// server that shares its cores with another one on the same machine (a decode beside its prefill)
// and should compute only in the time the other leaves. Threads created before the call (I/O,
// transfer engines) keep their policy. Registered as torch.ops.tandem.idle_compute_threads;
// returns how many threads now run under SCHED_IDLE, and raises with errno's text otherwise.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <sched.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

int64_t idle_compute_threads() {
  std::mutex lock;
  std::set<int> done;
  std::string error;
  auto to_idle = [&] {
    sched_param param{};
    bool ok = sched_setscheduler(0, SCHED_IDLE, &param) == 0;
    std::lock_guard<std::mutex> guard(lock);
    if (ok) {
      done.insert(at::get_thread_num());
    } else if (error.empty()) {
      error = std::strerror(errno);
    }
  };
  // One index per thread of the pool: at::parallel_for gives each thread one chunk of the range.
  int64_t threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { to_idle(); });
  TORCH_CHECK(error.empty(), "sched_setscheduler(SCHED_IDLE) failed: ", error);
  return static_cast<int64_t>(done.size());
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("idle_compute_threads() -> int", &idle_compute_threads);
}
