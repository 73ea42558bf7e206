#include "p2p.h"

#include <gloo/types.h>

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "errors.h"

namespace tnt_gloo {

namespace {

// What goes on the header slot before every message's payload.
struct Header {
  std::uint64_t magic;
  std::uint64_t tag;
  std::uint64_t nbytes;
};
constexpr std::uint64_t kHeaderMagic = 0x746e742d70327031ULL;  // "tnt-p2p1"

// The threads wait for messages that may come much later (between training phases);
// the user-facing timeout is enforced by Handle.wait on the Work, which fails the
// communicator and so aborts these waits. (A Gloo wait that times out closes every
// pair of the context, so it must not be used as a poll.)
constexpr std::chrono::milliseconds kForever = std::chrono::hours(24 * 365);

std::uint64_t header_slot() { return std::uint64_t{kP2pHeaderSlotPrefix} << 56; }

std::uint64_t payload_slot(std::uint64_t tag) {
  return (std::uint64_t{kP2pPayloadSlotPrefix} << 56) | (tag & kMaxP2pTag);
}

std::string size_error(std::size_t got, std::size_t room, int src, std::uint64_t tag) {
  return "a message of " + std::to_string(got) + " bytes from rank " + std::to_string(src) +
         " (tag " + std::to_string(tag) + ") does not match the receive buffer of " +
         std::to_string(room) + " bytes; send and receive buffers must have the same size";
}

}  // namespace

struct PointToPoint::SendOp {
  Header header{};
  std::unique_ptr<gloo::transport::UnboundBuffer> hbuf;
  std::unique_ptr<gloo::transport::UnboundBuffer> pbuf;  // null for an empty message
  std::shared_ptr<Work> work;
};

PointToPoint::PointToPoint(std::shared_ptr<gloo::Context> context, FailureCallback on_failure)
    : context_(std::move(context)),
      rank_(context_->rank),
      size_(context_->size),
      on_failure_(std::move(on_failure)) {}

PointToPoint::~PointToPoint() { shutdown("the communicator is closed"); }

void PointToPoint::check_usable_locked() const {
  if (closed_) throw GlooError("the communicator is closed");
  if (!failure_.empty()) throw GlooError("an earlier operation failed: " + failure_);
}

PointToPoint::Peer& PointToPoint::peer_locked(int rank) {
  auto& peer = peers_[rank];
  if (!peer) {
    peer = std::make_shared<Peer>();
    peer->rank = rank;
  }
  return *peer;
}

std::shared_ptr<Work> PointToPoint::send(const void* data, std::size_t nbytes, int dest,
                                         std::uint64_t tag, std::string name,
                                         Work::OnDone on_done) {
  if (dest < 0 || dest >= size_) throw std::invalid_argument("send: no such rank");
  if (tag > kMaxP2pTag) throw std::invalid_argument("send: tag out of range");
  auto work = std::make_shared<Work>(std::move(name), std::move(on_done));
  std::shared_ptr<RecvOp> target;  // a receive of this rank's own (dest == rank)
  std::string error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable_locked();
    if (dest == rank_) {
      // To itself: no wire, the bytes go straight to the receive (or wait for it).
      auto& channel = channels_[{rank_, tag}];
      if (!channel.posted.empty()) {
        target = channel.posted.front();
        channel.posted.pop_front();
        if (channel.posted.empty()) channels_.erase({rank_, tag});
        if (target->nbytes == nbytes) {
          if (nbytes > 0) std::memcpy(target->data, data, nbytes);
        } else {
          error = size_error(nbytes, target->nbytes, rank_, tag);
        }
      } else {
        auto message = std::make_shared<Message>();
        message->nbytes = nbytes;
        const char* bytes = static_cast<const char*>(data);
        message->data.assign(bytes, bytes + nbytes);
        message->arrived = true;
        channel.arrived.push_back(std::move(message));
      }
    } else {
      Peer& peer = peer_locked(dest);
      if (!peer.sender.joinable()) {
        peer.sender = std::thread(&PointToPoint::send_loop, this, std::ref(peer));
      }
      auto op = std::make_shared<SendOp>();
      op->header = Header{kHeaderMagic, tag, nbytes};
      op->work = work;
      try {
        op->hbuf = context_->createUnboundBuffer(&op->header, sizeof(Header));
        if (nbytes > 0) {
          op->pbuf = context_->createUnboundBuffer(const_cast<void*>(data), nbytes);
        }
        op->hbuf->send(dest, header_slot());
        if (op->pbuf) op->pbuf->send(dest, payload_slot(tag));
      } catch (...) {
        // The pair is broken (or the header went out without its payload): the pair's
        // stream of messages can no longer be trusted.
        error = "send to rank " + std::to_string(dest) + ": " +
                describe_exception(std::current_exception());
      }
      if (error.empty()) {
        peer.sends.push_back(std::move(op));
        peer.send_cv.notify_all();
        return work;
      }
    }
  }
  if (target) {
    target->work->complete(error);
    work->complete("");
    return work;
  }
  if (!error.empty()) {  // a failed post (not a loopback size mismatch)
    fail(error);
    on_failure_(error);
    throw GlooError(error);
  }
  work->complete("");  // loopback, kept for the receive
  return work;
}

std::shared_ptr<Work> PointToPoint::recv(void* data, std::size_t nbytes, int src,
                                         std::uint64_t tag, std::string name,
                                         Work::OnDone on_done) {
  if (src < 0 || src >= size_) throw std::invalid_argument("recv: no such rank");
  if (tag > kMaxP2pTag) throw std::invalid_argument("recv: tag out of range");
  auto work = std::make_shared<Work>(std::move(name), std::move(on_done));
  auto op = std::make_shared<RecvOp>(RecvOp{data, nbytes, work});
  std::shared_ptr<Message> ready;
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable_locked();
    auto& channel = channels_[{src, tag}];
    if (!channel.arrived.empty()) {
      auto message = channel.arrived.front();
      channel.arrived.pop_front();
      if (channel.arrived.empty()) channels_.erase({src, tag});
      if (message->arrived) {
        ready = std::move(message);
      } else {
        message->waiter = op;  // the receiving thread completes it
      }
    } else if (src != rank_ && !peer_locked(src).broken.empty()) {
      if (channel.posted.empty()) channels_.erase({src, tag});
      broken = peer_locked(src).broken;
    } else {
      channel.posted.push_back(op);
      if (src != rank_) {
        Peer& peer = peer_locked(src);
        if (!peer.receiver.joinable()) {
          peer.receiver = std::thread(&PointToPoint::receive_loop, this, std::ref(peer));
        }
      }
    }
  }
  if (!broken.empty()) {  // the peer's connection is gone: this message can never come
    fail(broken);
    on_failure_(broken);
    throw GlooError(broken);
  }
  if (ready) {
    if (ready->nbytes != nbytes) {
      work->complete(size_error(ready->nbytes, nbytes, src, tag));
    } else {
      if (nbytes > 0) std::memcpy(data, ready->data.data(), nbytes);
      work->complete("");
    }
  }
  return work;
}

void PointToPoint::receive_loop(Peer& peer) {
  const int src = peer.rank;
  Header header{};
  std::unique_ptr<gloo::transport::UnboundBuffer> hbuf;
  // The message being received: into a posted receive (target), or into a buffer of its
  // own (message), or dropped after a size mismatch (drain). Declared before pbuf, which
  // Gloo writes through: pbuf goes first.
  std::shared_ptr<RecvOp> target;
  std::shared_ptr<Message> message;
  std::vector<char> drain;
  std::unique_ptr<gloo::transport::UnboundBuffer> pbuf;
  std::string error;
  try {
    hbuf = context_->createUnboundBuffer(&header, sizeof(Header));
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (closed_ || !failure_.empty()) break;
        hbuf->recv(src, header_slot());
        peer.recv_waiting = hbuf.get();
      }
      const bool got = hbuf->waitRecv(kForever);  // throws if the pair broke
      {
        std::lock_guard<std::mutex> lock(mu_);
        peer.recv_waiting = nullptr;
        if (!got || closed_ || !failure_.empty()) break;
        if (header.magic != kHeaderMagic || header.tag > kMaxP2pTag) {
          throw GlooError("malformed point-to-point header (a peer of another version?)");
        }
        auto& channel = channels_[{src, header.tag}];
        if (!channel.posted.empty()) {
          target = channel.posted.front();
          channel.posted.pop_front();
          if (channel.posted.empty()) channels_.erase({src, header.tag});
        } else {
          message = std::make_shared<Message>();
          message->nbytes = header.nbytes;
          channel.arrived.push_back(message);
        }
      }
      const std::uint64_t tag = header.tag;
      const std::size_t nbytes = header.nbytes;
      if (nbytes > 0) {
        void* dst;
        if (target && target->nbytes == nbytes) {
          dst = target->data;
        } else if (target) {
          drain.resize(nbytes);
          dst = drain.data();
        } else {
          message->data.resize(nbytes);
          dst = message->data.data();
        }
        pbuf = context_->createUnboundBuffer(dst, nbytes);
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (closed_ || !failure_.empty()) break;
          pbuf->recv(src, payload_slot(tag));
          peer.recv_waiting = pbuf.get();
        }
        const bool done = pbuf->waitRecv(kForever);
        {
          std::lock_guard<std::mutex> lock(mu_);
          peer.recv_waiting = nullptr;
        }
        pbuf.reset();  // waits until Gloo no longer touches dst
        if (!done) break;
        drain = std::vector<char>();
      }
      if (target) {
        target->work->complete(target->nbytes == nbytes
                                   ? std::string()
                                   : size_error(nbytes, target->nbytes, src, tag));
        target.reset();
      } else {
        std::shared_ptr<RecvOp> waiter;
        {
          std::lock_guard<std::mutex> lock(mu_);
          message->arrived = true;
          waiter = std::move(message->waiter);
        }
        if (waiter) {
          if (waiter->nbytes != nbytes) {
            waiter->work->complete(size_error(nbytes, waiter->nbytes, src, tag));
          } else {
            if (nbytes > 0) std::memcpy(waiter->data, message->data.data(), nbytes);
            waiter->work->complete("");
          }
        }
        message.reset();
      }
    }
  } catch (...) {
    error = "receiving from rank " + std::to_string(src) + ": " +
            describe_exception(std::current_exception());
  }
  bool idle = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peer.recv_waiting = nullptr;
    if (!error.empty() && !target && !message) {
      // The connection broke while no message from this peer was awaited: the peer may
      // have closed its communicator after its last message, as at the end of a job.
      // Nothing failed yet; a later receive from it fails at once (see recv()).
      idle = true;
      for (const auto& [key, channel] : channels_) {
        if (key.first == src && !channel.posted.empty()) idle = false;
      }
      if (idle) peer.broken = error;
    }
  }
  pbuf.reset();
  if (!error.empty() && !idle) {
    fail(error);
    on_failure_(error);
  }
  // What this thread still owns fails with the communicator's failure.
  std::string reason;
  std::shared_ptr<RecvOp> waiter;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reason = closed_ && failure_.empty() ? "the communicator is closed" : failure_;
    if (message) waiter = std::move(message->waiter);
  }
  if (reason.empty()) reason = "the receiving thread stopped";
  if (target) target->work->complete(reason);
  if (waiter) waiter->work->complete(reason);
}

void PointToPoint::send_loop(Peer& peer) {
  const int dest = peer.rank;
  std::string error;
  for (;;) {
    std::shared_ptr<SendOp> op;
    {
      std::unique_lock<std::mutex> lock(mu_);
      peer.send_cv.wait(lock, [&] {
        return !peer.sends.empty() || closed_ || !failure_.empty();
      });
      if (closed_ || !failure_.empty()) break;
      op = peer.sends.front();
      peer.send_waiting = op->hbuf.get();
    }
    bool sent = false;
    try {
      sent = op->hbuf->waitSend(kForever);  // throws if the pair broke
      if (sent && op->pbuf) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (closed_ || !failure_.empty()) {
            sent = false;
          } else {
            peer.send_waiting = op->pbuf.get();
          }
        }
        if (sent) sent = op->pbuf->waitSend(kForever);
      }
    } catch (...) {
      error = "sending to rank " + std::to_string(dest) + ": " +
              describe_exception(std::current_exception());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      peer.send_waiting = nullptr;
      if (sent) peer.sends.pop_front();
    }
    if (!sent) break;
    op->hbuf.reset();
    op->pbuf.reset();
    op->work->complete("");
  }
  if (!error.empty()) {
    fail(error);
    on_failure_(error);
  }
  // Every send not completed fails, once Gloo let go of its buffers.
  std::deque<std::shared_ptr<SendOp>> rest;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rest.swap(peer.sends);
    reason = closed_ && failure_.empty() ? "the communicator is closed" : failure_;
  }
  for (auto& op : rest) {
    op->hbuf.reset();
    op->pbuf.reset();
    op->work->complete(reason);
  }
}

void PointToPoint::fail(const std::string& reason) { stop(reason, /*failure=*/true); }

void PointToPoint::stop(const std::string& reason, bool failure) {
  std::vector<std::shared_ptr<RecvOp>> orphans;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure && failure_.empty()) failure_ = reason;
    if (!failure) closed_ = true;
    why = failure_.empty() ? reason : failure_;
    // Receives no message was matched with yet: nothing writes into them, fail them now.
    for (auto& [key, channel] : channels_) {
      for (auto& op : channel.posted) orphans.push_back(op);
    }
    channels_.clear();
    // The threads own everything else: wake them (the abort sticks if the wait has not
    // started yet), they let go of Gloo's buffers and fail what they hold.
    for (auto& [rank, peer] : peers_) {
      if (peer->recv_waiting) peer->recv_waiting->abortWaitRecv();
      if (peer->send_waiting) peer->send_waiting->abortWaitSend();
      peer->send_cv.notify_all();
    }
  }
  for (auto& op : orphans) op->work->complete(why);
}

void PointToPoint::shutdown(const std::string& reason) {
  stop(reason, /*failure=*/false);
  std::vector<std::shared_ptr<Peer>> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [rank, peer] : peers_) peers.push_back(peer);
  }
  // closed_ is set: no thread starts any more.
  for (auto& peer : peers) {
    for (std::thread* thread : {&peer->receiver, &peer->sender}) {
      if (!thread->joinable()) continue;
      if (thread->get_id() == std::this_thread::get_id()) {
        thread->detach();  // never: only close() shuts down, never from these threads
      } else {
        thread->join();
      }
    }
  }
}

}  // namespace tnt_gloo
