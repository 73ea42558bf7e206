// Waiting on a word of shared memory: a short spin, then a futex (shared, not
// FUTEX_PRIVATE: the word may live in another process's segment). Used by the
// shared-memory allreduce and the point-to-point rings.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>

namespace tnt_gloo {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Spin until `ready()` for at most `spin` (one burst at least), yielding the CPU between
// bursts: the rank waited for may be queued behind this thread on its CPU (more ranks than
// CPUs, or other load); a yield costs < 1 us when nothing else is runnable, and without it
// a rank sharing its CPU with its peer spins its whole budget on every wait. True once
// ready.
template <typename Ready>
bool spin_until(Ready ready, std::chrono::nanoseconds spin) {
  if (ready()) return true;
  const auto end = std::chrono::steady_clock::now() + spin;
  do {
    for (int i = 0; i < 64; ++i) {
      cpu_relax();
      if (ready()) return true;
    }
    sched_yield();
  } while (std::chrono::steady_clock::now() < end);
  return ready();
}

// Sleep while *word == expected, at most `timeout`. EAGAIN (the value changed), ETIMEDOUT
// and EINTR all mean: look again.
inline void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected,
                       std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts,
          nullptr, 0);
}

inline void futex_wake(std::atomic<std::uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr,
          nullptr, 0);
}

}  // namespace tnt_gloo
