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
// Failures: a broken pair wakes the threads waiting on it (Gloo signals its pending
// buffers); they report it through `on_failure` (the communicator poisons itself, which
// calls fail() here). fail() completes every pending operation with the error; an
// operation's Work is completed only once Gloo can no longer write into its buffer. A
// connection that closes while no message from that peer is awaited is not a failure
// yet (the peer may have closed its communicator after its last message); a receive
// from it posted later is.
#pragma once

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

  PointToPoint(std::shared_ptr<gloo::Context> context, FailureCallback on_failure);
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
  };

  Peer& peer_locked(int rank);
  void receive_loop(Peer& peer);
  void send_loop(Peer& peer);
  void check_usable_locked() const;
  void stop(const std::string& reason, bool failure);

  const std::shared_ptr<gloo::Context> context_;
  const int rank_;
  const int size_;
  const FailureCallback on_failure_;

  mutable std::mutex mu_;  // guards everything below, and every post to Gloo
  std::string failure_;
  bool closed_ = false;
  std::map<int, std::shared_ptr<Peer>> peers_;
  std::map<std::pair<int, std::uint64_t>, Channel> channels_;
};

}  // namespace tnt_gloo
