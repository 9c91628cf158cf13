// CUDA API costs on this machine: launch, event record, stream wait, alone and with a second
// thread doing event records meanwhile (the driver serializes calls of one context).
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <thread>
#include <atomic>
__global__ void empty(int* p, dim3 x) { if (p && threadIdx.x == 1234567) *p = 1; }
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  cudaSetDevice(0);
  cudaStream_t s, u; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&u, cudaStreamNonBlocking);
  cudaEvent_t ev[64]; for (auto& e : ev) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  const int N = 20000;
  empty<<<1, 32, 0, s>>>(nullptr, dim3(1)); cudaStreamSynchronize(s);
  auto bench = [&](const char* what, auto fn) {
    for (int i = 0; i < 1000; ++i) fn(i);
    cudaStreamSynchronize(s); cudaStreamSynchronize(u);
    double t = now();
    for (int i = 0; i < N; ++i) { fn(i); if (i % 512 == 511) { cudaStreamSynchronize(s); } }
    double dt = (now() - t) / N * 1e6;
    cudaStreamSynchronize(s); cudaStreamSynchronize(u);
    printf("%-44s %6.2f us\n", what, dt);
  };
  bench("launch empty 1x32", [&](int) { empty<<<1, 32, 0, s>>>(nullptr, dim3(1)); });
  bench("launch empty (32,1)x256", [&](int) { empty<<<dim3(32, 1), 256, 0, s>>>(nullptr, dim3(1)); });
  bench("cudaEventRecord", [&](int i) { cudaEventRecord(ev[i % 64], u); });
  bench("cudaEventRecord on the legacy stream 0", [&](int i) { cudaEventRecord(ev[i % 64], 0); });
  bench("cudaEventRecord on cudaStreamPerThread", [&](int i) { cudaEventRecord(ev[i % 64], cudaStreamPerThread); });
  bench("cudaStreamWaitEvent (other stream's)", [&](int i) { cudaStreamWaitEvent(s, ev[i % 64], 0); });
  bench("record(u)+wait(s)+launch(s)", [&](int i) { cudaEventRecord(ev[i % 64], u); cudaStreamWaitEvent(s, ev[i % 64], 0); empty<<<dim3(32, 1), 256, 0, s>>>(nullptr, dim3(1)); });
  bench("cudaStreamQuery (idle stream)", [&](int) { cudaStreamQuery(u); });
  bench("cudaEventQuery", [&](int i) { cudaEventQuery(ev[i % 64]); });
  std::atomic<bool> stop{false};
  std::thread other([&] { int i = 0; while (!stop) { cudaEventRecord(ev[i++ % 64], u); } });
  bench("launch, another thread recording events", [&](int) { empty<<<dim3(32, 1), 256, 0, s>>>(nullptr, dim3(1)); });
  stop = true; other.join();
  return 0;
}
