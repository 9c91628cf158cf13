/* Preloaded (LD_PRELOAD) into a test's peer process: cudaHostAlloc fails with
   cudaErrorMemoryAllocation while the environment variable P2P_TEST_FAIL_HOST_ALLOC is set to a
   non-empty value, and is CUDA's own otherwise. Lets a GPU test run the engine out of pinned
   memory at a moment of its choosing (test_ipc.py). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdlib.h>

typedef int (*host_alloc_fn)(void**, size_t, unsigned int);

int cudaHostAlloc(void** ptr, size_t size, unsigned int flags) {
  const char* fail = getenv("P2P_TEST_FAIL_HOST_ALLOC");
  if (fail && *fail) {
    *ptr = NULL;
    return 2; /* cudaErrorMemoryAllocation */
  }
  static host_alloc_fn real;
  if (!real) real = (host_alloc_fn)dlsym(RTLD_NEXT, "cudaHostAlloc");
  return real ? real(ptr, size, flags) : 2;
}
