// What a launch costs the launching thread against the size of its parameter block (the IPC
// route passes a call's page ids in the launch's parameters, 8 bytes per page).
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstring>
template <size_t N> struct Params { alignas(16) char bytes[N]; };
template <size_t N> __global__ void take(const __grid_constant__ Params<N> p, int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && p.bytes[N - 1] == 123) *out = 1;
}
__global__ void spin(long long cycles) { long long t = clock64(); while (clock64() - t < cycles) {} }
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
template <size_t N> double bench(cudaStream_t s, int* out) {
  Params<N> p; memset(p.bytes, 0, N);
  const int n = 20000;
  for (int i = 0; i < 1000; ++i) take<N><<<32, 256, 0, s>>>(p, out);
  cudaStreamSynchronize(s);
  double in_launch = 0;
  for (int i = 0; i < n; ++i) {
    const double t = now();
    take<N><<<32, 256, 0, s>>>(p, out);
    in_launch += now() - t;
    if (i % 64 == 63) cudaStreamSynchronize(s);
  }
  cudaStreamSynchronize(s);
  return in_launch / n * 1e6;
}
int main() {
  cudaSetDevice(0); cudaFree(0);
  cudaStream_t s, busy; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking);
  int* out; cudaMalloc(&out, 4);
  for (int b = 0; b < 2; ++b) {
    if (b) spin<<<1, 1, 0, busy>>>(4000000000LL);
    printf("%s: params 64 B %.2f us, 1008 %.2f, 2032 %.2f, 4032 %.2f, 8128 %.2f, 12224 %.2f, 32704 %.2f\n",
           b ? "another stream busy" : "GPU idle", bench<64>(s, out), bench<1008>(s, out), bench<2032>(s, out),
           bench<4032>(s, out), bench<8128>(s, out), bench<12224>(s, out), bench<32704>(s, out));
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
