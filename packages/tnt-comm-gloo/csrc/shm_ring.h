// A one-way byte stream between two ranks on one host: a ring in the receiver's
// shared-memory segment that one sender fills and one receiver drains, for the
// point-to-point messages of ranks that share a host (p2p.h).
//
// Why: over Gloo's TCP pairs a message is a header, then the payload once the receiver
// has posted a buffer for it (Gloo's unbound buffers), carried by the threads of both
// processes; on the development VM that is 168 us one way for 4 bytes and 207 us for
// 256 KB, and in a pipelined step under load 0.45-0.65 ms (median), against 2.4 us to
// copy 256 KB. Through the ring the sending thread copies the message in itself, and
// the receiving thread (asleep on a futex when the ring is empty) copies it out.
//
// Positions are byte counts since the start (never wrapped; 2^64 bytes do not occur), so
// head - tail is what the ring holds. The sender alone writes `head` and the receiver
// alone `tail`; each publishes with a release store, then bumps its futex word and wakes
// the other side only if it announced itself asleep.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace tnt_gloo {

// In shared memory, zero-filled when the segment is made (all positions 0). Sender's and
// receiver's fields on separate cache lines.
struct RingControl {
  alignas(64) std::atomic<std::uint64_t> head;  // bytes written, by the sender
  std::atomic<std::uint32_t> head_seq;           // bumped after head moves: the reader's futex
  std::atomic<std::uint32_t> reader_asleep;
  alignas(64) std::atomic<std::uint64_t> tail;  // bytes consumed, by the receiver
  std::atomic<std::uint32_t> tail_seq;           // bumped after tail moves: the writer's futex
  std::atomic<std::uint32_t> writer_asleep;
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "cross-process atomics must be lock-free");

class ShmRing {
 public:
  ShmRing() = default;
  ShmRing(RingControl* control, char* data, std::size_t capacity)
      : c_(control), data_(data), capacity_(capacity) {}
  bool valid() const { return c_ != nullptr; }

  // Sender: copy up to `n` bytes from `src` into the free part of the ring; returns how
  // many went in (0 when it is full).
  std::size_t write_some(const void* src, std::size_t n);
  // Receiver: copy up to `n` waiting bytes into `dst` (skip them when `dst` is null);
  // returns how many.
  std::size_t read_some(void* dst, std::size_t n);
  std::size_t readable() const;

  // Sleep until there is something to read / room to write, `spin` spinning first, at
  // most `slice` (then the caller looks for failures and calls again).
  void wait_readable(std::chrono::nanoseconds spin, std::chrono::nanoseconds slice);
  void wait_writable(std::chrono::nanoseconds spin, std::chrono::nanoseconds slice);
  // Wake both sides' sleepers (a failure or close: they look at their flags).
  void wake();

 private:
  RingControl* c_ = nullptr;
  char* data_ = nullptr;
  std::size_t capacity_ = 0;
};

}  // namespace tnt_gloo
