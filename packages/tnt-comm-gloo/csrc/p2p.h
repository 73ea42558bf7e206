// Point-to-point messages (send/recv) over Gloo's unbound buffers, beside the collective
// worker thread.
//
// Why not on the worker: the worker runs collectives one at a time, each until it
// completes; a receive queued behind an allreduce of another group (or of this one,
// waiting for a rank that first waits for this message) would deadlock. Sends and
// receives are posted to Gloo directly from the caller's thread instead (Gloo's pairs
// are thread-safe; the slots below are apart from every collective's), and completed by
// small threads of their own, one per peer and direction, started at the first message
// to or from that peer. They block in Gloo's waits (no spinning) and never take the
// worker's context lock.
//
// Wire format: every message is a header (tag, byte count) on the pair's header slot,
// then the payload on a slot derived from the tag. The receiving side learns the size
// from the header before it posts the payload receive: Gloo would truncate a longer
// receive silently and abort the process on a shorter one, so a size mismatch fails
// only that receive here (the payload is drained) and the sender is unaffected. A
// message whose receive is not posted yet is received into a buffer of its own and
// copied when the receive comes (so a send completes without waiting for the receiver's
// program, as MPI's eager protocol does); one whose receive is posted lands in place.
// Order per (peer, tag) is the order of the headers, which is the order of the sends.
//
// Ranks on one host (the communicator's shared-memory group, shm_allreduce.h) send
// through a ring in the receiver's segment instead (shm_ring.h): the same header and
// payload as one stream, copied in by the sending thread itself as far as the ring has
// room (the rest by the peer's sending thread), and out by the peer's receiving thread,
// which sleeps on the ring's futex in slices and looks between them for this object's
// failure and for the peer's exit, close or failure. A peer gone while nothing from it is
// awaited is handled as a closed connection below.
//
// Failures: a broken pair wakes the threads waiting on it (Gloo signals its pending
// buffers); they report it through `on_failure` (the communicator poisons itself, which
// calls fail() here). fail() completes every pending operation with the error; an
// operation's Work is completed only once Gloo can no longer write into its buffer. A
// connection that closes while no message from that peer is awaited is not a failure
// yet (the peer may have closed its communicator after its last message); a receive
// from it posted later is.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include "communicator.h"
#include "shm_allreduce.h"

namespace tnt_gloo {

// Slot prefixes (top byte of Gloo's 64-bit slot). Gloo's collectives use 0x01-0x08
// (gloo/types.h), recursive doubling 0x7d; these are apart from all of them.
constexpr std::uint8_t kP2pHeaderSlotPrefix = 0xe0;
constexpr std::uint8_t kP2pPayloadSlotPrefix = 0xe1;
// Tags are below 2**31 (the Python layer checks; MPI's guaranteed range is smaller).
constexpr std::uint64_t kMaxP2pTag = (std::uint64_t{1} << 31) - 1;

class PointToPoint {
 public:
  using FailureCallback = std::function<void(const std::string&)>;

  // `shm`: the shared-memory group of this rank's host, if the communicator has one (its
  // ranks' messages go through rings); null: every message goes over Gloo.
  PointToPoint(std::shared_ptr<gloo::Context> context, FailureCallback on_failure,
               std::shared_ptr<ShmAllreduce> shm = nullptr);
  ~PointToPoint();

  PointToPoint(const PointToPoint&) = delete;
  PointToPoint& operator=(const PointToPoint&) = delete;

  // Start sending `nbytes` at `data` to `dest`; `data` must stay valid until the Work
  // is done. Throws GlooError if the communicator failed or Gloo refuses the post (then
  // `on_done` is never called; else once, see Work::OnDone, possibly before this returns).
  std::shared_ptr<Work> send(const void* data, std::size_t nbytes, int dest,
                             std::uint64_t tag, std::string name,
                             Work::OnDone on_done = nullptr);
  // Start receiving the next message from `src` with `tag` into `nbytes` at `data`.
  std::shared_ptr<Work> recv(void* data, std::size_t nbytes, int src, std::uint64_t tag,
                             std::string name, Work::OnDone on_done = nullptr);

  // "shm" (through the rings: the peer shares this host's shared-memory group), "self" or
  // "tcp": what a message to or from `peer` goes over.
  const char* transport(int peer) const {
    if (peer == rank_) return "self";
    return shm_ && shm_->local_of(peer) >= 0 ? "shm" : "tcp";
  }

  // Fail every pending operation and every later call with `reason` (the first reason
  // wins); wake the threads. Never blocks on the network; callable from any thread.
  void fail(const std::string& reason);
  // fail(reason), then join the threads. Call without the GIL, not from a p2p thread.
  void shutdown(const std::string& reason);

 private:
  // A posted receive: where the message goes, and the Work to complete.
  struct RecvOp {
    void* data;
    std::size_t nbytes;
    std::shared_ptr<Work> work;
  };
  // A message whose receive was not posted when its header came: its payload goes to
  // `data` (`arrived` once there); a receive posted meanwhile waits as `waiter`.
  struct Message {
    std::size_t nbytes = 0;
    std::vector<char> data;
    bool arrived = false;
    std::shared_ptr<RecvOp> waiter;
  };
  // One (peer, tag): receives not matched yet, messages not matched yet (at most one
  // of the two is non-empty).
  struct Channel {
    std::deque<std::shared_ptr<RecvOp>> posted;
    std::deque<std::shared_ptr<Message>> arrived;
  };
  struct SendOp;
  // One peer: its receiving and sending threads (started at first use), the Gloo buffer
  // each one waits on (so fail() can abort that wait), and the sends not completed yet.
  struct Peer {
    int rank = 0;
    std::thread receiver;
    std::thread sender;
    gloo::transport::UnboundBuffer* recv_waiting = nullptr;
    gloo::transport::UnboundBuffer* send_waiting = nullptr;
    std::deque<std::shared_ptr<SendOp>> sends;
    std::condition_variable send_cv;
    // Why the connection broke while no message from the peer was awaited ("" if not).
    std::string broken;
    // On this host: the peer's index in the shared-memory group (else -1), the sends not
    // yet wholly in its ring (in order; guarded by write_mu, which orders the writes).
    int local = -1;
    std::mutex write_mu;
    std::condition_variable shm_cv;  // with write_mu: shm_sends filled, or stopping
    std::deque<std::shared_ptr<SendOp>> shm_sends;
  };

  Peer& peer_locked(int rank);
  // A receiving thread's parts, whatever the transport: the receive a message whose
  // header came goes to (`target`: the oldest posted for its peer and tag), else a
  // `message` held until one is posted; complete the receive of a message
  // whose payload is in (`target`, or `message` and the receive posted for it since);
  // after the peer's connection (or the peer) went: mark it broken unless a receive from
  // it is posted (then true: nothing failed yet); at the thread's end: fail what it holds.
  void match_locked(int src, std::uint64_t tag, std::size_t nbytes,
                    std::shared_ptr<RecvOp>& target, std::shared_ptr<Message>& message);
  void deliver(int src, std::uint64_t tag, std::size_t nbytes, std::shared_ptr<RecvOp>& target,
               std::shared_ptr<Message>& message);
  bool broken_if_idle_locked(Peer& peer, const std::string& why);
  void fail_owned(std::shared_ptr<RecvOp>& target, std::shared_ptr<Message>& message);
  void receive_loop(Peer& peer);
  void send_loop(Peer& peer);
  // The same through the peer's rings (shm_ring.h).
  std::shared_ptr<Work> shm_send(const void* data, std::size_t nbytes, int dest,
                                 std::uint64_t tag, std::shared_ptr<Work> work);
  void shm_receive_loop(Peer& peer);
  void shm_send_loop(Peer& peer);
  // Read exactly `n` bytes of the peer's ring into `dst` (skipped if null). False if this
  // object stopped or the peer is gone (`why` says which, "" for a stop).
  bool shm_read(Peer& peer, ShmRing& ring, void* dst, std::size_t n, std::string* why);
  void check_usable_locked() const;
  void stop(const std::string& reason, bool failure);

  const std::shared_ptr<gloo::Context> context_;
  const int rank_;
  const int size_;
  const FailureCallback on_failure_;
  const std::shared_ptr<ShmAllreduce> shm_;
  std::atomic<bool> stopping_{false};  // set with closed_ or failure_, read without mu_

  mutable std::mutex mu_;  // guards everything below, and every post to Gloo
  std::string failure_;
  bool closed_ = false;
  std::map<int, std::shared_ptr<Peer>> peers_;
  std::map<std::pair<int, std::uint64_t>, Channel> channels_;
};

}  // namespace tnt_gloo
