#include "shm_ring.h"

#include <algorithm>
#include <cstring>

#include "shm_futex.h"

namespace tnt_gloo {

namespace {

// Announce, re-check, sleep on `seq`: the other side bumps `seq` after it moves its
// position and wakes only when `asleep` is set, so a wake is never missed.
template <typename Ready>
void sleep_until(Ready ready, std::atomic<std::uint32_t>* seq, std::atomic<std::uint32_t>* asleep,
                 std::chrono::nanoseconds slice) {
  asleep->store(1, std::memory_order_seq_cst);
  const std::uint32_t seen = seq->load(std::memory_order_seq_cst);
  if (!ready()) futex_wait(seq, seen, slice);
  asleep->store(0, std::memory_order_seq_cst);
}

void publish(std::atomic<std::uint32_t>* seq, std::atomic<std::uint32_t>* asleep) {
  seq->fetch_add(1, std::memory_order_seq_cst);
  if (asleep->load(std::memory_order_seq_cst) != 0) futex_wake(seq);
}

}  // namespace

std::size_t ShmRing::write_some(const void* src, std::size_t n) {
  const std::uint64_t head = c_->head.load(std::memory_order_relaxed);  // ours alone
  const std::uint64_t tail = c_->tail.load(std::memory_order_acquire);
  const std::size_t room = capacity_ - static_cast<std::size_t>(head - tail);
  const std::size_t k = std::min(n, room);
  if (k == 0) return 0;
  const std::size_t at = static_cast<std::size_t>(head % capacity_);
  const std::size_t first = std::min(k, capacity_ - at);
  std::memcpy(data_ + at, src, first);
  if (k > first) std::memcpy(data_, static_cast<const char*>(src) + first, k - first);
  c_->head.store(head + k, std::memory_order_release);
  publish(&c_->head_seq, &c_->reader_asleep);
  return k;
}

std::size_t ShmRing::read_some(void* dst, std::size_t n) {
  const std::uint64_t tail = c_->tail.load(std::memory_order_relaxed);  // ours alone
  const std::uint64_t head = c_->head.load(std::memory_order_acquire);
  const std::size_t k = std::min(n, static_cast<std::size_t>(head - tail));
  if (k == 0) return 0;
  if (dst != nullptr) {
    const std::size_t at = static_cast<std::size_t>(tail % capacity_);
    const std::size_t first = std::min(k, capacity_ - at);
    std::memcpy(dst, data_ + at, first);
    if (k > first) std::memcpy(static_cast<char*>(dst) + first, data_, k - first);
  }
  c_->tail.store(tail + k, std::memory_order_release);
  publish(&c_->tail_seq, &c_->writer_asleep);
  return k;
}

std::size_t ShmRing::readable() const {
  return static_cast<std::size_t>(c_->head.load(std::memory_order_acquire) -
                                  c_->tail.load(std::memory_order_relaxed));
}

void ShmRing::wait_readable(std::chrono::nanoseconds spin, std::chrono::nanoseconds slice) {
  auto ready = [this] { return readable() > 0; };
  if (spin_until(ready, spin)) return;
  sleep_until(ready, &c_->head_seq, &c_->reader_asleep, slice);
}

void ShmRing::wait_writable(std::chrono::nanoseconds spin, std::chrono::nanoseconds slice) {
  auto ready = [this] {
    return c_->head.load(std::memory_order_relaxed) -
               c_->tail.load(std::memory_order_acquire) < capacity_;
  };
  if (spin_until(ready, spin)) return;
  sleep_until(ready, &c_->tail_seq, &c_->writer_asleep, slice);
}

void ShmRing::wake() {
  c_->head_seq.fetch_add(1, std::memory_order_seq_cst);
  futex_wake(&c_->head_seq);
  c_->tail_seq.fetch_add(1, std::memory_order_seq_cst);
  futex_wake(&c_->tail_seq);
}

}  // namespace tnt_gloo
