/* Preloaded (LD_PRELOAD) into a test's peer process, so that CUDA fails at a moment the test
   chooses (test_ipc.py), and is CUDA's own otherwise:
   - cudaHostAlloc fails with cudaErrorMemoryAllocation while P2P_TEST_FAIL_HOST_ALLOC is set
     to a non-empty value;
   - cudaEventRecord on any stream but the legacy default one (torch's default stream) fails
     while P2P_TEST_FAIL_EVENT_RECORD is set: CUDA's own, handed no event, so that CUDA's last
     error is set as by any failed call. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdlib.h>

static int failing(const char* name) {
  const char* v = getenv(name);
  return v && *v;
}

typedef int (*host_alloc_fn)(void**, size_t, unsigned int);

int cudaHostAlloc(void** ptr, size_t size, unsigned int flags) {
  if (failing("P2P_TEST_FAIL_HOST_ALLOC")) {
    *ptr = NULL;
    return 2; /* cudaErrorMemoryAllocation */
  }
  static host_alloc_fn real;
  if (!real) real = (host_alloc_fn)dlsym(RTLD_NEXT, "cudaHostAlloc");
  return real ? real(ptr, size, flags) : 2;
}

typedef int (*event_record_fn)(void*, void*);

int cudaEventRecord(void* event, void* stream) {
  static event_record_fn real;
  if (!real) real = (event_record_fn)dlsym(RTLD_NEXT, "cudaEventRecord");
  if (!real) return 400; /* cudaErrorInvalidResourceHandle */
  return real(stream && failing("P2P_TEST_FAIL_EVENT_RECORD") ? NULL : event, stream);
}
