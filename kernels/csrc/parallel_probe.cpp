// How many threads one at::parallel_for region runs on. at::parallel_for is compiled into each
// library from ATen's headers: without OpenMP at build time it runs serially, silently. cpu_ops.py
// builds with -fopenmp, so that the kernels share torch's OpenMP pool; the tests check it here.
// Registered as torch.ops.tandem.parallel_threads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <mutex>
#include <set>

int64_t parallel_threads() {
  std::mutex lock;
  std::set<int> seen;
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> guard(lock);
    seen.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(seen.size());
}

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("parallel_threads() -> int", &parallel_threads);
}
