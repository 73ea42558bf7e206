// Waiting on a word of shared memory: a futex (shared, not FUTEX_PRIVATE: the word may
// live in another process's segment) and the CPU's spin hint. Used by the shared-memory
// allreduce and the point-to-point rings.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
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
