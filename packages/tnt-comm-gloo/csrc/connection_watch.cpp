#include "connection_watch.h"

#include <gloo/types.h>

#include <chrono>
#include <utility>

#include "errors.h"

namespace tnt_gloo {

namespace {

// The sentinel's slot: a prefix no collective and no point-to-point message uses
// (interruptible.cpp's are 0x79-0x7e, p2p.h's 0xe0 and 0xe1).
constexpr std::uint8_t kSentinelSlotPrefix = 0x78;
// Longer than any job: Gloo ends a receive's wait that times out by failing every pair.
constexpr std::chrono::hours kForever(24 * 365);

}  // namespace

ConnectionWatch::ConnectionWatch(const std::shared_ptr<gloo::Context>& context,
                                 std::function<void(const std::string&)> on_failure)
    : sentinel_(context->createUnboundBuffer(&byte_, 1)) {
  const std::uint64_t slot = gloo::Slot::build(kSentinelSlotPrefix, 0);
  // A peer may have closed its side already (it found a configuration error the same set-up
  // gives every rank, and left): posting on that pair throws. That is a failure to report,
  // as any later one, not an error of the set-up: the rank goes on to find the same error.
  std::string failed;
  try {
    for (int peer = 0; peer < context->size; ++peer) {
      if (peer != context->rank) sentinel_->recv(peer, slot);
    }
  } catch (...) {
    failed = describe_exception(std::current_exception());
  }
  thread_ = std::thread([buffer = sentinel_.get(), on_failure = std::move(on_failure),
                         failed = std::move(failed)] {
    if (!failed.empty()) {
      on_failure(failed);
      return;
    }
    try {
      if (!buffer->waitRecv(kForever)) return;  // stopped
    } catch (...) {
      on_failure(describe_exception(std::current_exception()));
    }
  });
}

ConnectionWatch::~ConnectionWatch() {
  sentinel_->abortWaitRecv();
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();  // the last owner let go from the callback: it ends by itself
  } else if (thread_.joinable()) {
    thread_.join();
  }
}

}  // namespace tnt_gloo
