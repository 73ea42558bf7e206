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
  // Through a ring: the payload, and how much of header + payload is in the ring so far.
  const char* data = nullptr;
  std::size_t written = 0;
};

PointToPoint::PointToPoint(std::shared_ptr<gloo::Context> context, FailureCallback on_failure,
                           std::shared_ptr<ShmAllreduce> shm)
    : context_(std::move(context)),
      rank_(context_->rank),
      size_(context_->size),
      on_failure_(std::move(on_failure)),
      shm_(std::move(shm)) {}

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
    if (shm_ && rank != rank_) peer->local = shm_->local_of(rank);
  }
  return *peer;
}

std::shared_ptr<Work> PointToPoint::send(const void* data, std::size_t nbytes, int dest,
                                         std::uint64_t tag, std::string name,
                                         Work::OnDone on_done) {
  if (dest < 0 || dest >= size_) throw std::invalid_argument("send: no such rank");
  if (tag > kMaxP2pTag) throw std::invalid_argument("send: tag out of range");
  auto work = std::make_shared<Work>(std::move(name), std::move(on_done));
  if (dest != rank_ && shm_ && shm_->local_of(dest) >= 0) {
    return shm_send(data, nbytes, dest, tag, std::move(work));
  }
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
          peer.receiver = std::thread(peer.local >= 0 ? &PointToPoint::shm_receive_loop
                                                      : &PointToPoint::receive_loop,
                                      this, std::ref(peer));
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

void PointToPoint::match_locked(int src, std::uint64_t tag, std::size_t nbytes,
                                std::shared_ptr<RecvOp>& target,
                                std::shared_ptr<Message>& message) {
  auto& channel = channels_[{src, tag}];
  if (!channel.posted.empty()) {
    target = channel.posted.front();
    channel.posted.pop_front();
    if (channel.posted.empty()) channels_.erase({src, tag});
  } else {
    message = std::make_shared<Message>();
    message->nbytes = nbytes;
    channel.arrived.push_back(message);
  }
}

void PointToPoint::deliver(int src, std::uint64_t tag, std::size_t nbytes,
                           std::shared_ptr<RecvOp>& target, std::shared_ptr<Message>& message) {
  if (target) {
    target->work->complete(target->nbytes == nbytes ? std::string()
                                                    : size_error(nbytes, target->nbytes, src, tag));
    target.reset();
    return;
  }
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

bool PointToPoint::broken_if_idle_locked(Peer& peer, const std::string& why) {
  for (const auto& [key, channel] : channels_) {
    if (key.first == peer.rank && !channel.posted.empty()) return false;
  }
  peer.broken = why;
  return true;
}

void PointToPoint::fail_owned(std::shared_ptr<RecvOp>& target,
                              std::shared_ptr<Message>& message) {
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
        match_locked(src, header.tag, header.nbytes, target, message);
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
      deliver(src, tag, nbytes, target, message);
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
      idle = broken_if_idle_locked(peer, error);
    }
  }
  pbuf.reset();
  if (!error.empty() && !idle) {
    fail(error);
    on_failure_(error);
  }
  // What this thread still owns fails with the communicator's failure.
  fail_owned(target, message);
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

// ---------------------------------------------------------------- through the rings

namespace {
// Sleeps between looks at failures and the peer; the bound on how late a dead peer is
// noticed when its connection's watch does not tell first.
constexpr auto kRingSlice = std::chrono::milliseconds(20);
}  // namespace

std::shared_ptr<Work> PointToPoint::shm_send(const void* data, std::size_t nbytes, int dest,
                                             std::uint64_t tag, std::shared_ptr<Work> work) {
  std::shared_ptr<Peer> peer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable_locked();
    peer_locked(dest);
    peer = peers_[dest];
    if (!peer->sender.joinable()) {
      peer->sender = std::thread(&PointToPoint::shm_send_loop, this, std::ref(*peer));
    }
  }
  auto op = std::make_shared<SendOp>();
  op->header = Header{kHeaderMagic, tag, nbytes};
  op->work = work;
  op->data = static_cast<const char*>(data);
  ShmRing ring = shm_->ring(shm_->rank(), peer->local);
  bool done = false;
  {
    std::lock_guard<std::mutex> lock(peer->write_mu);
    if (peer->shm_sends.empty()) {  // nothing ahead of it: this thread copies it in
      op->written = ring.write_some(&op->header, sizeof(Header));
      if (op->written == sizeof(Header) && nbytes > 0) {
        op->written += ring.write_some(op->data, nbytes);
      }
      done = op->written == sizeof(Header) + nbytes;
    }
    if (!done) peer->shm_sends.push_back(op);  // the rest: the peer's sending thread
  }
  if (done) {
    work->complete("");
  } else {
    peer->shm_cv.notify_all();
  }
  return work;
}

void PointToPoint::shm_send_loop(Peer& peer) {
  const int dest = peer.rank;
  ShmRing ring = shm_->ring(shm_->rank(), peer.local);
  std::string error;
  while (!stopping_.load()) {
    std::shared_ptr<SendOp> op;
    bool done = false;
    {
      std::unique_lock<std::mutex> lock(peer.write_mu);
      peer.shm_cv.wait(lock, [&] { return !peer.shm_sends.empty() || stopping_.load(); });
      if (peer.shm_sends.empty()) continue;
      op = peer.shm_sends.front();
      if (op->written < sizeof(Header)) {
        op->written += ring.write_some(reinterpret_cast<const char*>(&op->header) + op->written,
                                       sizeof(Header) - op->written);
      }
      const std::size_t total = sizeof(Header) + op->header.nbytes;
      if (op->written >= sizeof(Header) && op->written < total) {
        const std::size_t at = op->written - sizeof(Header);
        op->written += ring.write_some(op->data + at, op->header.nbytes - at);
      }
      done = op->written == total;
      if (done) peer.shm_sends.pop_front();
    }
    if (done) {
      op->work->complete("");
      continue;
    }
    const std::string gone = shm_->peer_gone(peer.local);
    if (!gone.empty()) {
      error = "sending to rank " + std::to_string(dest) + ": " + gone;
      break;
    }
    ring.wait_writable(shm_->spin(), kRingSlice);
  }
  if (!error.empty()) {
    fail(error);
    on_failure_(error);
  }
  // Every send not wholly in the ring fails (the caller may free its buffer now).
  std::deque<std::shared_ptr<SendOp>> rest;
  {
    std::lock_guard<std::mutex> lock(peer.write_mu);
    rest.swap(peer.shm_sends);
  }
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reason = closed_ && failure_.empty() ? "the communicator is closed" : failure_;
  }
  if (reason.empty()) reason = error.empty() ? "the sending thread stopped" : error;
  for (auto& op : rest) op->work->complete(reason);
}

bool PointToPoint::shm_read(Peer& peer, ShmRing& ring, void* dst, std::size_t n,
                            std::string* why) {
  char* out = static_cast<char*>(dst);
  std::size_t got = 0;
  while (got < n) {
    const std::size_t k = ring.read_some(out == nullptr ? nullptr : out + got, n - got);
    got += k;
    if (k > 0) continue;
    if (stopping_.load()) {
      why->clear();
      return false;
    }
    // What a peer wrote before it went is still read: only an empty ring asks.
    const std::string gone = shm_->peer_gone(peer.local);
    if (!gone.empty() && ring.readable() == 0) {
      *why = gone;
      return false;
    }
    ring.wait_readable(shm_->spin(), kRingSlice);
  }
  return true;
}

void PointToPoint::shm_receive_loop(Peer& peer) {
  const int src = peer.rank;
  ShmRing ring = shm_->ring(peer.local, shm_->rank());
  std::shared_ptr<RecvOp> target;
  std::shared_ptr<Message> message;
  std::string error;   // a failure of this pair
  std::string gone;    // the peer went (exit, close, failure)
  bool midway = false;  // between a message's header and the end of its payload
  for (;;) {
    Header header{};
    if (!shm_read(peer, ring, &header, sizeof(Header), &gone)) break;
    midway = true;
    if (header.magic != kHeaderMagic || header.tag > kMaxP2pTag) {
      error = "receiving from rank " + std::to_string(src) +
              ": malformed point-to-point header in the shared-memory ring";
      break;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_ || !failure_.empty()) break;
      match_locked(src, header.tag, header.nbytes, target, message);
    }
    const std::size_t nbytes = header.nbytes;
    // (outside the lock: no one reads a message's data before it has arrived)
    if (message) message->data.resize(nbytes);
    void* dst = target ? (target->nbytes == nbytes ? target->data : nullptr)  // null: drained
                       : static_cast<void*>(message->data.data());
    if (!shm_read(peer, ring, dst, nbytes, &gone)) break;
    midway = false;
    deliver(src, header.tag, nbytes, target, message);
  }
  if (!gone.empty() && error.empty()) {
    error = "receiving from rank " + std::to_string(src) + ": " + gone;
    bool idle = !midway && !target && !message;
    if (idle) {  // as a connection closed while nothing was awaited (see p2p.h)
      std::lock_guard<std::mutex> lock(mu_);
      idle = broken_if_idle_locked(peer, error);
    }
    if (idle) error.clear();
  }
  if (!error.empty()) {
    fail(error);
    on_failure_(error);
  }
  fail_owned(target, message);
}

void PointToPoint::fail(const std::string& reason) { stop(reason, /*failure=*/true); }

void PointToPoint::stop(const std::string& reason, bool failure) {
  std::vector<std::shared_ptr<RecvOp>> orphans;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure && failure_.empty()) failure_ = reason;
    if (!failure) closed_ = true;
    stopping_.store(true);
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
      if (peer->local >= 0) {  // the ring threads sleep on the rings' futexes, or on shm_cv
        const int me = shm_->rank();
        shm_->ring(peer->local, me).wake();
        shm_->ring(me, peer->local).wake();
        { std::lock_guard<std::mutex> write(peer->write_mu); }  // its thread waits, or sees stopping_
        peer->shm_cv.notify_all();
      }
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
