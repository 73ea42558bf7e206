#include "interruptible.h"

#include <gloo/types.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "errors.h"
#include "shm_allreduce.h"

namespace tnt_gloo {

Interrupt::Watch::Watch(Interrupt* interrupt,
                        std::initializer_list<gloo::transport::UnboundBuffer*> buffers)
    : interrupt_(interrupt), buffers_(buffers) {
  if (interrupt_ == nullptr) return;
  std::lock_guard<std::mutex> lock(interrupt_->mu_);
  if (interrupt_->fired_) throw GlooError("interrupted: the caller gave up the operation");
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

void Interrupt::fire() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  fired_ = true;
  // Gloo keeps each abort until the next wait on that buffer consumes it, so a wait that
  // starts after this still ends at once.
  for (auto* buffer : watched_) {
    buffer->abortWaitRecv();
    buffer->abortWaitSend();
  }
}

namespace {

// Slot prefixes (top byte of Gloo's 64-bit slot): Gloo's collectives use small ones, the
// point-to-point messages 0xe0 and 0xe1 (p2p.h); the per-operation tag keeps operations
// apart anyway.
constexpr std::uint8_t kDoublingSlotPrefix = 0x7d;
constexpr std::uint8_t kRingSlotPrefix = 0x7e;

// Both throw gloo::IoException on timeout or a broken connection.
void wait_recv(gloo::transport::UnboundBuffer& buffer, const Exec& exec, const char* what) {
  if (!buffer.waitRecv(exec.timeout)) {
    throw GlooError(std::string(what) + " was interrupted: the caller gave up the operation");
  }
}

void wait_send(gloo::transport::UnboundBuffer& buffer, const Exec& exec, const char* what) {
  if (!buffer.waitSend(exec.timeout)) {
    throw GlooError(std::string(what) + " was interrupted: the caller gave up the operation");
  }
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

}  // namespace tnt_gloo
