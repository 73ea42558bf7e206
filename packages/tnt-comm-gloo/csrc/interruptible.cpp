#include "interruptible.h"

#include <gloo/types.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"
#include "shm_allreduce.h"

namespace tnt_gloo {

Interrupt::Watch::Watch(Interrupt* interrupt,
                        std::initializer_list<gloo::transport::UnboundBuffer*> buffers)
    : interrupt_(interrupt), buffers_(buffers) {
  if (interrupt_ == nullptr) return;
  std::lock_guard<std::mutex> lock(interrupt_->mu_);
  if (interrupt_->fired_) throw GlooError("interrupted: " + interrupt_->reason_);
  interrupt_->watched_.insert(interrupt_->watched_.end(), buffers_.begin(), buffers_.end());
}

Interrupt::Watch::~Watch() {
  if (interrupt_ == nullptr) return;
  std::lock_guard<std::mutex> lock(interrupt_->mu_);
  auto& watched = interrupt_->watched_;
  for (auto* buffer : buffers_) {
    watched.erase(std::find(watched.begin(), watched.end(), buffer));
  }
}

void Interrupt::fire(const std::string& reason) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (!fired_) {
    try {
      reason_ = reason;
    } catch (...) {
      // out of memory: the waits end all the same, without the reason
    }
  }
  fired_ = true;
  // Gloo keeps each abort until the next wait on that buffer consumes it, so a wait that
  // starts after this still ends at once.
  for (auto* buffer : watched_) {
    buffer->abortWaitRecv();
    buffer->abortWaitSend();
  }
}

std::string Interrupt::reason() {
  std::lock_guard<std::mutex> lock(mu_);
  return reason_;
}

namespace {

// Slot prefixes (top byte of Gloo's 64-bit slot): Gloo's collectives use small ones, the
// point-to-point messages 0xe0 and 0xe1 (p2p.h); the per-operation tag keeps operations
// apart anyway.
constexpr std::uint8_t kHalvingDoublingSlotPrefix = 0x79;
constexpr std::uint8_t kBroadcastSlotPrefix = 0x7a;
constexpr std::uint8_t kAllgatherSlotPrefix = 0x7b;
constexpr std::uint8_t kBarrierSlotPrefix = 0x7c;
constexpr std::uint8_t kDoublingSlotPrefix = 0x7d;
constexpr std::uint8_t kRingSlotPrefix = 0x7e;

[[noreturn]] void interrupted(const Exec& exec, const char* what) {
  const std::string reason = exec.interrupt != nullptr ? exec.interrupt->reason() : "";
  throw GlooError(std::string(what) + " was interrupted: " +
                  (reason.empty() ? "the caller gave up the operation" : reason));
}

// Both throw gloo::IoException on timeout or a broken connection.
void wait_recv(gloo::transport::UnboundBuffer& buffer, const Exec& exec, const char* what) {
  if (!buffer.waitRecv(exec.timeout)) interrupted(exec, what);
}

void wait_send(gloo::transport::UnboundBuffer& buffer, const Exec& exec, const char* what) {
  if (!buffer.waitSend(exec.timeout)) interrupted(exec, what);
}

}  // namespace

void allreduce_doubling(const Exec& exec, void* data, std::size_t count, std::size_t elsize,
                        const ReduceFunc& reduce) {
  const auto& context = exec.context;
  const int rank = context->rank;
  const int size = context->size;
  if (size & (size - 1)) {
    throw std::invalid_argument("recursive doubling needs a power-of-two number of ranks");
  }
  const std::size_t nbytes = count * elsize;
  if (exec.scratch.size() < nbytes) exec.scratch.resize(nbytes);
  char* incoming = exec.scratch.data();
  auto out = context->createUnboundBuffer(data, nbytes);
  auto in = context->createUnboundBuffer(incoming, nbytes);
  const Interrupt::Watch watch(exec.interrupt, {out.get(), in.get()});
  std::uint8_t step = 0;
  for (int mask = 1; mask < size; mask <<= 1, ++step) {
    const int peer = rank ^ mask;
    const std::uint64_t slot = gloo::Slot::build(kDoublingSlotPrefix, exec.tag) + step;
    in->recv(peer, slot);
    out->send(peer, slot);
    wait_recv(*in, exec, "recursive doubling");
    wait_send(*out, exec, "recursive doubling");
    if (rank < peer) {
      reduce(data, data, incoming, count);
    } else {
      reduce(data, incoming, data, count);
    }
  }
}

void allreduce_ring(const Exec& exec, void* data, std::size_t count, std::size_t elsize,
                    const ReduceFunc& reduce) {
  const auto& context = exec.context;
  const int rank = context->rank;
  const int size = context->size;
  auto slice = [&](int index) {
    return ShmAllreduce::slice(count, size, ((index % size) + size) % size);
  };
  const std::size_t longest = slice(0).second - slice(0).first;  // the first is longest
  if (exec.scratch.size() < longest * elsize) exec.scratch.resize(longest * elsize);
  char* const bytes = static_cast<char*>(data);
  char* const incoming = exec.scratch.data();
  auto whole = context->createUnboundBuffer(data, count * elsize);
  auto scratch = context->createUnboundBuffer(incoming, longest * elsize);
  const Interrupt::Watch watch(exec.interrupt, {whole.get(), scratch.get()});
  const int right = (rank + 1) % size;
  const int left = (rank + size - 1) % size;
  for (int step = 0; step < 2 * (size - 1); ++step) {
    // Reduce-scatter: send slice rank - s, add the left's slice rank - s - 1 into ours;
    // after it, slice rank + 1 is complete here. Allgather: pass complete slices on.
    const bool reducing = step < size - 1;
    const int s = reducing ? step : step - (size - 1);
    const auto out = slice(reducing ? rank - s : rank + 1 - s);
    const auto in = slice(reducing ? rank - s - 1 : rank - s);
    const std::size_t n_out = out.second - out.first;
    const std::size_t n_in = in.second - in.first;
    const std::uint64_t slot = gloo::Slot::build(kRingSlotPrefix, exec.tag) + step;
    if (n_in > 0) {
      if (reducing) {
        scratch->recv(left, slot, 0, n_in * elsize);
      } else {
        whole->recv(left, slot, in.first * elsize, n_in * elsize);
      }
    }
    if (n_out > 0) whole->send(right, slot, out.first * elsize, n_out * elsize);
    if (n_in > 0) {
      wait_recv(reducing ? *scratch : *whole, exec, "the ring allreduce");
      if (reducing) {
        char* const mine = bytes + in.first * elsize;
        reduce(mine, incoming, mine, n_in);  // what came round the ring first
      }
    }
    if (n_out > 0) wait_send(*whole, exec, "the ring allreduce");
  }
}

void allreduce_halving_doubling(const Exec& exec, void* data, std::size_t count,
                                std::size_t elsize, const ReduceFunc& reduce) {
  const auto& context = exec.context;
  const int rank = context->rank;
  const int size = context->size;
  int pof2 = 1;
  while (pof2 * 2 <= size) pof2 *= 2;
  const int folded = size - pof2;  // pairs (2i, 2i + 1), i < folded, act as one rank
  const std::size_t nbytes = count * elsize;
  if (exec.scratch.size() < nbytes) exec.scratch.resize(nbytes);
  char* const bytes = static_cast<char*>(data);
  char* const incoming = exec.scratch.data();
  auto whole = context->createUnboundBuffer(data, nbytes);
  auto scratch = context->createUnboundBuffer(incoming, nbytes);
  const Interrupt::Watch watch(exec.interrupt, {whole.get(), scratch.get()});
  // Slots: 0 the fold, 1..2 log2(2^k) the halving and doubling steps, the next the unfold.
  const std::uint64_t base = gloo::Slot::build(kHalvingDoublingSlotPrefix, exec.tag);
  int levels = 0;
  while ((1 << levels) < pof2) ++levels;
  const std::uint64_t fold_slot = base, unfold_slot = base + (1 + 2 * levels);
  std::uint8_t step = 1;
  // Send [send_lo, send_hi) to `peer` and receive its [recv_lo, recv_hi) (elements), into
  // the scratch buffer (`into_scratch`) or in place.
  auto exchange = [&](int peer, std::size_t send_lo, std::size_t send_hi, std::size_t recv_lo,
                      std::size_t recv_hi, bool into_scratch) {
    const std::uint64_t slot = base + step++;
    if (recv_hi > recv_lo) {
      if (into_scratch) {
        scratch->recv(peer, slot, 0, (recv_hi - recv_lo) * elsize);
      } else {
        whole->recv(peer, slot, recv_lo * elsize, (recv_hi - recv_lo) * elsize);
      }
    }
    if (send_hi > send_lo) whole->send(peer, slot, send_lo * elsize, (send_hi - send_lo) * elsize);
    if (recv_hi > recv_lo) {
      wait_recv(into_scratch ? *scratch : *whole, exec, "the halving-doubling allreduce");
    }
    if (send_hi > send_lo) wait_send(*whole, exec, "the halving-doubling allreduce");
  };
  const bool paired = rank < 2 * folded;
  if (paired && rank % 2 == 0) {
    // Fold: hand the buffer to the odd rank of the pair, which takes part for both; the
    // result comes back at the end.
    whole->recv(rank + 1, unfold_slot);
    whole->send(rank + 1, fold_slot);
    wait_send(*whole, exec, "the halving-doubling allreduce");
    wait_recv(*whole, exec, "the halving-doubling allreduce");
    return;
  }
  if (paired) {
    scratch->recv(rank - 1, fold_slot);
    wait_recv(*scratch, exec, "the halving-doubling allreduce");
    reduce(bytes, incoming, bytes, count);  // the even rank's first
  }
  // The 2^k ranks left, numbered 0..2^k - 1 (`actual` maps back).
  const int me = paired ? rank / 2 : rank - folded;
  auto actual = [&](int v) { return v < folded ? 2 * v + 1 : v + folded; };
  std::vector<std::pair<std::size_t, std::size_t>> ranges;  // the range before each halving
  std::size_t lo = 0, hi = count;
  for (int mask = pof2 / 2; mask > 0; mask >>= 1) {
    // The peer has the same range; the lower of the two keeps and reduces its lower half.
    const bool lower = (me & mask) == 0;
    const std::size_t mid = lo + (hi - lo) / 2;
    const std::size_t keep_lo = lower ? lo : mid, keep_hi = lower ? mid : hi;
    ranges.emplace_back(lo, hi);
    exchange(actual(me ^ mask), lower ? mid : lo, lower ? hi : mid, keep_lo, keep_hi, true);
    char* const mine = bytes + keep_lo * elsize;
    if (lower) {
      reduce(mine, mine, incoming, keep_hi - keep_lo);
    } else {
      reduce(mine, incoming, mine, keep_hi - keep_lo);
    }
    lo = keep_lo;
    hi = keep_hi;
  }
  for (int mask = 1; mask < pof2; mask <<= 1) {
    // The peer holds the other part of the range this one was halved from.
    const auto [whole_lo, whole_hi] = ranges.back();
    ranges.pop_back();
    const bool lower = lo == whole_lo;
    exchange(actual(me ^ mask), lo, hi, lower ? hi : whole_lo, lower ? whole_hi : lo, false);
    lo = whole_lo;
    hi = whole_hi;
  }
  if (paired) {
    whole->send(rank - 1, unfold_slot);
    wait_send(*whole, exec, "the halving-doubling allreduce");
  }
}

void broadcast_tree(const Exec& exec, void* data, std::size_t nbytes, int root) {
  const auto& context = exec.context;
  const int size = context->size;
  const int me = (context->rank - root + size) % size;  // counted from the root
  auto actual = [&](int relative) { return (relative + root) % size; };
  auto buffer = context->createUnboundBuffer(data, nbytes);
  const Interrupt::Watch watch(exec.interrupt, {buffer.get()});
  const std::uint64_t slot = gloo::Slot::build(kBroadcastSlotPrefix, exec.tag);
  // The lowest set bit of `me` names the round it receives in, from me - that bit; the
  // root (0) receives nothing. Then it sends to me + each lower power of two.
  int mask = 1;
  while (mask < size) {
    if (me & mask) {
      buffer->recv(actual(me - mask), slot);
      wait_recv(*buffer, exec, "the broadcast");
      break;
    }
    mask <<= 1;
  }
  int sends = 0;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (me + mask < size) {
      buffer->send(actual(me + mask), slot);
      ++sends;
    }
  }
  for (int i = 0; i < sends; ++i) wait_send(*buffer, exec, "the broadcast");
}

void allgather_ring(const Exec& exec, const void* in, void* out, std::size_t nbytes) {
  const auto& context = exec.context;
  const int rank = context->rank;
  const int size = context->size;
  char* const blocks = static_cast<char*>(out);
  std::memmove(blocks + static_cast<std::size_t>(rank) * nbytes, in, nbytes);  // may be in place
  auto whole = context->createUnboundBuffer(out, nbytes * static_cast<std::size_t>(size));
  const Interrupt::Watch watch(exec.interrupt, {whole.get()});
  const int right = (rank + 1) % size;
  const int left = (rank + size - 1) % size;
  for (int step = 0; step < size - 1; ++step) {
    // Pass on block rank - step (ours at first), take block rank - step - 1.
    const std::size_t send_block = static_cast<std::size_t>((rank - step + size) % size);
    const std::size_t recv_block = static_cast<std::size_t>((rank - step - 1 + 2 * size) % size);
    const std::uint64_t slot = gloo::Slot::build(kAllgatherSlotPrefix, exec.tag) + step;
    whole->recv(left, slot, recv_block * nbytes, nbytes);
    whole->send(right, slot, send_block * nbytes, nbytes);
    wait_recv(*whole, exec, "the allgather");
    wait_send(*whole, exec, "the allgather");
  }
}

void barrier_dissemination(const Exec& exec) {
  const auto& context = exec.context;
  const int rank = context->rank;
  const int size = context->size;
  char token = 0, heard = 0;
  auto out = context->createUnboundBuffer(&token, 1);
  auto in = context->createUnboundBuffer(&heard, 1);
  const Interrupt::Watch watch(exec.interrupt, {out.get(), in.get()});
  std::uint8_t round = 0;
  for (int distance = 1; distance < size; distance <<= 1, ++round) {
    const std::uint64_t slot = gloo::Slot::build(kBarrierSlotPrefix, exec.tag) + round;
    in->recv((rank - distance + size) % size, slot);
    out->send((rank + distance) % size, slot);
    wait_recv(*in, exec, "the barrier");
    wait_send(*out, exec, "the barrier");
  }
}

}  // namespace tnt_gloo
