// Would launching the page copy from the calling thread (on its own stream: stream order for
// free) cost it less than today's stream check (a query of its idle stream while the worker
// launches the copies)? Times per call of the calling thread's CUDA part, calls every ~12 us.
#include <cuda_runtime.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
struct Params { char* dst; const char* src; int n; int pairs[2 * 256 + 2]; };  // ~2 KiB, as a 256-page call
__global__ void copy_pages(Params p) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (warp >= p.n) return;
  const int4* s = reinterpret_cast<const int4*>(p.src + (size_t)p.pairs[2 * warp] * 4096);
  int4* d = reinterpret_cast<int4*>(p.dst + (size_t)p.pairs[2 * warp + 1] * 4096);
  for (int i = lane; i < 256; i += 32) d[i] = s[i];
}
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
void pause_us(double us) { double t = now(); while (now() - t < us * 1e-6) {} }
int main() {
  cudaSetDevice(0); cudaFree(0);
  char *src, *dst; cudaMalloc(&src, 4096 * 4096); cudaMalloc(&dst, 4096 * 4096);
  Params p{dst, src, 256, {}};
  std::vector<int> perm(4096); for (int i = 0; i < 4096; ++i) perm[i] = i;
  srand(1); std::random_shuffle(perm.begin(), perm.end());
  for (int k = 0; k < 256; ++k) { p.pairs[2 * k] = perm[k]; p.pairs[2 * k + 1] = perm[4095 - k]; }
  cudaStream_t c, w; cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&w, cudaStreamNonBlocking);
  const int N = 20000;
  const double gaps[] = {12.0, 8.0, 4.0};
  for (double gap : gaps) {
    for (int round = 0; round < 2; ++round) {
      // Today: another thread launches the copies; this one queries its idle stream per call.
      std::atomic<bool> stop{false}; std::atomic<long> launched{0};
      std::thread worker([&] { while (!stop) { copy_pages<<<32, 256, 0, w>>>(p); ++launched; pause_us(gap); if (launched % 64 == 0) cudaStreamSynchronize(w); } });
      pause_us(2000);
      double spent = 0;
      for (int i = 0; i < N; ++i) { double t = now(); cudaStreamQuery(c); spent += now() - t; pause_us(gap); }
      stop = true; worker.join(); cudaDeviceSynchronize();
      printf("gap %4.1f us, round %d: query of the idle caller stream, worker launching: %5.2f us\n", gap, round, spent / N * 1e6);
      // Proposal: this thread launches the copy on its stream; nobody else calls CUDA.
      spent = 0;
      for (int i = 0; i < N; ++i) { double t = now(); copy_pages<<<32, 256, 0, c>>>(p); spent += now() - t; pause_us(gap); if (i % 64 == 63) cudaStreamSynchronize(c); }
      cudaDeviceSynchronize();
      printf("gap %4.1f us, round %d: launch of the copy from the calling thread:        %5.2f us\n", gap, round, spent / N * 1e6);
      // Proposal with a worker that polls an event per copy (the completion it would need).
      spent = 0;
      std::vector<cudaEvent_t> evs(64); for (auto& e : evs) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
      double spent2 = 0;
      for (int i = 0; i < N; ++i) { double t = now(); copy_pages<<<32, 256, 0, c>>>(p); double t2 = now(); cudaEventRecord(evs[i % 64], c); spent += t2 - t; spent2 += now() - t2; pause_us(gap); if (i % 64 == 63) cudaStreamSynchronize(c); }
      cudaDeviceSynchronize();
      printf("gap %4.1f us, round %d: launch + event record: launch %5.2f us, record %5.2f us\n", gap, round, spent / N * 1e6, spent2 / N * 1e6);
      for (auto& e : evs) cudaEventDestroy(e);
    }
  }
  cudaError_t rc = cudaGetLastError();
  printf("last error: %s\n", cudaGetErrorString(rc));
  return 0;
}
