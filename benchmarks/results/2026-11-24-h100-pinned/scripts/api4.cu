// Which idle streams are slow to query while the GPU is busy? Legacy default stream against
// created streams (non-blocking, blocking) and the per-thread default stream.
#include <cuda.h>
#include <cuda_runtime.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
__global__ void spin(long long cycles) { long long t = clock64(); while (clock64() - t < cycles) {} }
__global__ void empty(int* p) { if (p && threadIdx.x == 1234567) *p = 1; }
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  cudaSetDevice(0); cudaFree(0);
  cudaStream_t s, u, b, w;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&u, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&b, cudaStreamDefault);
  cudaStreamCreateWithFlags(&w, cudaStreamNonBlocking);
  cudaEvent_t ev; cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  const int N = 20000;
  auto bench = [&](const char* what, auto fn) {
    for (int i = 0; i < 1000; ++i) fn(i);
    double t = now();
    for (int i = 0; i < N; ++i) fn(i);
    printf("%-70s %6.2f us\n", what, (now() - t) / N * 1e6);
  };
  struct Q { const char* name; cudaStream_t st; } qs[] = {
    {"legacy 0", 0}, {"per-thread default", cudaStreamPerThread}, {"created non-blocking", u}, {"created blocking", b}};
  // Give each stream one finished kernel, as a user's stream would have.
  for (auto& q : qs) empty<<<1, 32, 0, q.st>>>(nullptr);
  cudaDeviceSynchronize();
  char name[160];
  for (auto& q : qs) { snprintf(name, sizeof name, "query %s, GPU idle", q.name); bench(name, [&](int) { cudaStreamQuery(q.st); }); }
  spin<<<1, 1, 0, s>>>(3000000000LL);  // seconds of one SM on a non-blocking stream
  for (auto& q : qs) {
    if (q.st == 0 || q.st == b) continue;  // the blocking ones would wait for... nothing: s is non-blocking
  }
  for (auto& q : qs) { snprintf(name, sizeof name, "query %s, a kernel running on another stream", q.name); bench(name, [&](int) { cudaStreamQuery(q.st); }); }
  bench("cuStreamQuery(CU_STREAM_LEGACY) (driver API), kernel running", [&](int) { cuStreamQuery(CU_STREAM_LEGACY); });
  for (auto& q : qs) { snprintf(name, sizeof name, "event record on %s, kernel running", q.name); bench(name, [&](int) { cudaEventRecord(ev, q.st); }); }
  cudaDeviceSynchronize();
  std::atomic<bool> stop{false};
  std::thread other([&] {
    int i = 0;
    while (!stop) { empty<<<32, 256, 0, w>>>(nullptr); double t = now(); while (now() - t < 7e-6) {} if (++i % 256 == 0) cudaStreamSynchronize(w); }
  });
  for (auto& q : qs) { snprintf(name, sizeof name, "query %s, another thread launching every ~10 us", q.name); bench(name, [&](int) { cudaStreamQuery(q.st); }); }
  stop = true; other.join();
  return 0;
}
