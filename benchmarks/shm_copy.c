// What a copy into shared memory costs when another core reads it: the physics under the
// shared-memory allreduce of tnt-comm-gloo (csrc/shm_allreduce.cpp, copy_to_slot).
//
// Two processes, held to CPU 0 (the writer) and CPU 1 (the reader), share one buffer.
// Each round the writer copies --bytes from its private buffer into the shared one and
// raises a flag; the reader adds the shared buffer into a private one and raises its
// flag; and again. The writer copies with memcpy (the caches' way: every line the reader
// holds from the round before is first taken back from the other core) or with
// non-temporal stores (past the caches), alternating round by round so that load from
// other processes hits both alike. Printed per mode: the writer's copy and the reader's
// add, mean and best over the rounds, in microseconds.
//
//   cc -O2 -o /tmp/shm_copy benchmarks/shm_copy.c && /tmp/shm_copy 2678824
#define _GNU_SOURCE
#include <emmintrin.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { ROUNDS = 400, WARMUP = 20 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);
}

static void stream_copy(char* d, const char* s, size_t n) {  // d 16-byte aligned
  size_t i = 0;
  for (; i + 16 <= n; i += 16) _mm_stream_si128((__m128i*)(d + i), _mm_loadu_si128((const __m128i*)(s + i)));
  memcpy(d + i, s + i, n - i);
  _mm_sfence();
}

struct shared {
  _Atomic long flag;
  double reader_s[2][ROUNDS];
};

int main(int argc, char** argv) {
  const size_t bytes = argc > 1 ? strtoul(argv[1], NULL, 10) : 2678824;
  const size_t n = bytes / sizeof(float);
  struct shared* sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  float* slot = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(slot, 0, bytes);
  atomic_store(&sh->flag, 0);
  pid_t child = fork();
  if (child == 0) {  // the reader
    pin(1);
    float* mine = calloc(n, sizeof(float));
    for (long r = 0; r < ROUNDS; ++r) {
      while (atomic_load(&sh->flag) != 2 * r + 1) {}
      double t = now();
      for (size_t i = 0; i < n; ++i) mine[i] += slot[i];
      sh->reader_s[r % 2][r / 2] = now() - t;
      atomic_store(&sh->flag, 2 * r + 2);
    }
    _exit(mine[n / 2] == 12345.f);
  }
  pin(0);
  float* src = aligned_alloc(64, (bytes + 63) / 64 * 64);
  for (size_t i = 0; i < n; ++i) src[i] = (float)i;
  double writer_s[2][ROUNDS];
  for (long r = 0; r < ROUNDS; ++r) {
    while (atomic_load(&sh->flag) != 2 * r) {}
    double t = now();
    if (r % 2) stream_copy((char*)slot, (const char*)src, bytes);
    else memcpy(slot, src, bytes);
    writer_s[r % 2][r / 2] = now() - t;
    atomic_store(&sh->flag, 2 * r + 1);
  }
  waitpid(child, NULL, 0);
  printf("%zu bytes, %d rounds per mode after %d, writer on CPU 0, reader on CPU 1 (us)\n", bytes,
         ROUNDS / 2 - WARMUP, WARMUP);
  const char* names[2] = {"memcpy", "non-temporal stores"};
  for (int m = 0; m < 2; ++m) {
    double wsum = 0, wbest = 1e9, rsum = 0, rbest = 1e9;
    for (int k = WARMUP; k < ROUNDS / 2; ++k) {
      wsum += writer_s[m][k];
      rsum += sh->reader_s[m][k];
      if (writer_s[m][k] < wbest) wbest = writer_s[m][k];
      if (sh->reader_s[m][k] < rbest) rbest = sh->reader_s[m][k];
    }
    const double k = ROUNDS / 2 - WARMUP;
    printf("  %-20s copy mean %8.1f best %8.1f (%5.2f GB/s mean);  reader's add mean %8.1f best %8.1f\n",
           names[m], 1e6 * wsum / k, 1e6 * wbest, bytes / (wsum / k) / 1e9, 1e6 * rsum / k, 1e6 * rbest);
  }
  return 0;
}
