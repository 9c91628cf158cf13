// Costs of telling whether a stream's earlier work is done, from a thread other than the one
// that launches: a query, an event record, a stream write of a host-visible value; alone and
// while another thread launches kernels (as the engine's worker does).
#include <cuda.h>
#include <cuda_runtime.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <string>
__global__ void empty(int* p) { if (p && threadIdx.x == 1234567) *p = 1; }
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  cudaSetDevice(0);
  cudaFree(0);
  cudaStream_t s, u; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&u, cudaStreamNonBlocking);
  cudaEvent_t ev[64]; for (auto& e : ev) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  unsigned* flag; cudaHostAlloc(&flag, 4096, cudaHostAllocMapped | cudaHostAllocPortable);
  unsigned* dflag; cudaHostGetDevicePointer((void**)&dflag, flag, 0);
  int memops = 0; cuDeviceGetAttribute(&memops, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, 0);
  printf("stream mem ops: %d\n", memops);
  const int N = 20000;
  auto bench = [&](const char* what, auto fn) {
    for (int i = 0; i < 1000; ++i) fn(i);
    cudaDeviceSynchronize();
    double t = now();
    for (int i = 0; i < N; ++i) fn(i);
    double dt = (now() - t) / N * 1e6;
    cudaDeviceSynchronize();
    printf("%-56s %6.2f us\n", what, dt);
  };
  auto all = [&](const char* tag) {
    char name[128];
    snprintf(name, sizeof name, "cudaStreamQuery(legacy 0)%s", tag); bench(name, [&](int) { cudaStreamQuery(0); });
    snprintf(name, sizeof name, "cudaStreamQuery(u)%s", tag); bench(name, [&](int) { cudaStreamQuery(u); });
    snprintf(name, sizeof name, "cudaEventRecord(legacy 0)%s", tag); bench(name, [&](int i) { cudaEventRecord(ev[i % 64], 0); });
    snprintf(name, sizeof name, "cuStreamWriteValue32(legacy 0)%s", tag);
    bench(name, [&](int i) { cuStreamWriteValue32(0, (CUdeviceptr)dflag, i, 0); });
    snprintf(name, sizeof name, "cuStreamWriteValue32(u)%s", tag);
    bench(name, [&](int i) { cuStreamWriteValue32((CUstream)u, (CUdeviceptr)(dflag + 1), i, 0); });
    snprintf(name, sizeof name, "cuStreamWriteValue32 no barrier(u)%s", tag);
    bench(name, [&](int i) { cuStreamWriteValue32((CUstream)u, (CUdeviceptr)(dflag + 1), i, CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER); });
    // Round trip: write on an idle stream, spin until the host sees it.
    double t = now(); int n = 2000;
    for (int i = 1; i <= n; ++i) {
      cuStreamWriteValue32(0, (CUdeviceptr)(dflag + 2), 1000000 * (tag[0] != 0) + i, 0);
      while (__atomic_load_n(flag + 2, __ATOMIC_ACQUIRE) != 1000000u * (tag[0] != 0) + i) {}
    }
    printf("%-56s %6.2f us\n", (std::string("write -> seen on host (legacy 0)") + tag).c_str(), (now() - t) / n * 1e6);
  };
  all("");
  std::atomic<bool> stop{false};
  std::atomic<long> launches{0};
  std::thread other([&] {
    while (!stop) {
      empty<<<32, 256, 0, s>>>(nullptr);
      double t = now(); while (now() - t < 6e-6) {}
      if (++launches % 256 == 0) cudaStreamSynchronize(s);
    }
  });
  all(", another thread launching");
  bench("cuStreamWaitValue32(s) on a reached value", [&](int i) { cuStreamWaitValue32((CUstream)u, (CUdeviceptr)(dflag + 2), 0, CU_STREAM_WAIT_VALUE_GEQ); });
  stop = true; other.join();
  return 0;
}
