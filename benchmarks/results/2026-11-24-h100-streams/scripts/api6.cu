// Is the caller's stream check slow because the stream is the legacy default stream? Query and
// event-record cost of four kinds of idle stream, alone and while the GPU is busy.
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
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&u, cudaStreamNonBlocking);
  cudaStreamCreate(&b); cudaStreamCreateWithFlags(&w, cudaStreamNonBlocking);
  cudaEvent_t ev[64]; for (auto& e : ev) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  const int N = 20000;
  auto bench = [&](const char* what, auto fn) {
    for (int i = 0; i < 1000; ++i) fn(i);
    double t = now();
    for (int i = 0; i < N; ++i) fn(i);
    return (now() - t) / N * 1e6;
  };
  struct { const char* name; cudaStream_t st; } streams[] = {
      {"legacy default (0)", 0}, {"per-thread default", cudaStreamPerThread}, {"created, blocking", b}, {"created, non-blocking", u}};
  std::atomic<int> mode{0};
  std::atomic<bool> stop{false};
  std::thread other([&] {
    while (!stop) {
      if (mode == 1) { empty<<<32, 256, 0, w>>>(nullptr); double t = now(); while (now() - t < 7e-6) {} }
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  });
  const char* conds[] = {"GPU idle", "a kernel running on another stream", "another thread launching every ~8 us"};
  for (int c = 0; c < 3; ++c) {
    if (c == 1) spin<<<1, 1, 0, s>>>(4000000000LL);
    if (c == 2) { cudaDeviceSynchronize(); mode = 1; }
    for (auto& st : streams) {
      double q = bench("", [&](int) { cudaStreamQuery(st.st); });
      double r = bench("", [&](int i) { cudaEventRecord(ev[i % 64], st.st); });
      printf("%-36s %-24s query %5.2f us, event record %5.2f us\n", conds[c], st.name, q, r);
    }
  }
  stop = true; other.join();
  cudaDeviceSynchronize();
  return 0;
}
