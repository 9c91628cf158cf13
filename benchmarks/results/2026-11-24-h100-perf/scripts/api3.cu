// Is a stream query slow because another thread holds the driver, or because the GPU is busy?
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
  cudaStream_t s, u, w; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&u, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&w, cudaStreamNonBlocking);
  cudaEvent_t ev[64]; for (auto& e : ev) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  const int N = 20000;
  auto bench = [&](const char* what, auto fn) {
    for (int i = 0; i < 1000; ++i) fn(i);
    double t = now();
    for (int i = 0; i < N; ++i) fn(i);
    printf("%-64s %6.2f us\n", what, (now() - t) / N * 1e6);
  };
  bench("cudaStreamQuery(legacy 0), alone", [&](int) { cudaStreamQuery(0); });
  spin<<<1, 1, 0, s>>>(1000000000LL);  // about half a second of one SM
  bench("cudaStreamQuery(legacy 0), a kernel running on another stream", [&](int) { cudaStreamQuery(0); });
  bench("cudaStreamQuery(s), its kernel running", [&](int) { cudaStreamQuery(s); });
  cudaDeviceSynchronize();
  std::atomic<int> mode{0};
  std::atomic<bool> stop{false};
  std::thread other([&] {
    int i = 0;
    while (!stop) {
      if (mode == 1) cudaEventRecord(ev[i++ % 64], w);
      else if (mode == 2) cudaStreamQuery(w);
      else if (mode == 3) { empty<<<32, 256, 0, w>>>(nullptr); if (++i % 256 == 0) cudaStreamSynchronize(w); }
      else if (mode == 4) { empty<<<32, 256, 0, w>>>(nullptr); double t = now(); while (now() - t < 7e-6) {} if (++i % 256 == 0) cudaStreamSynchronize(w); }
    }
  });
  const char* names[] = {"", "another thread recording events in a loop", "another thread querying a stream in a loop",
                         "another thread launching back to back", "another thread launching every ~12 us"};
  for (int m = 1; m <= 4; ++m) {
    mode = m;
    char name[128]; snprintf(name, sizeof name, "cudaStreamQuery(legacy 0), %s", names[m]);
    bench(name, [&](int) { cudaStreamQuery(0); });
  }
  for (int m = 1; m <= 4; ++m) {
    mode = m;
    char name[128]; snprintf(name, sizeof name, "other thread's op, %s (timed here: 200 ms)", names[m]);
    (void)name;
  }
  stop = true; other.join();
  // The other side: how long a launch takes alone.
  bench("launch empty (32 blocks), alone", [&](int i) { empty<<<32, 256, 0, w>>>(nullptr); if (i % 256 == 255) cudaStreamSynchronize(w); });
  return 0;
}
