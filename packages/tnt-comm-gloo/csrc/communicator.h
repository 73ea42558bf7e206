// A Gloo full-mesh TCP communicator whose collectives run on one worker thread.
//
// Python submits operations; the worker executes them strictly in submission order
// (the contract's "same order on every rank"), never touching Python objects, so it runs
// without the GIL. Each submission returns a Work whose wait() blocks on a condition
// variable. After one operation fails the communicator is poisoned: its connections are
// closed (so peers blocked on this rank fail fast instead of waiting for their timeout)
// and every later operation fails at once with the first error.
//
// Sends and receives do not go through the worker: they run beside it on the same
// context (p2p.h), so neither waits for the other. A failure of either poisons both.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gloo/context.h>
#include <gloo/rendezvous/store.h>

#include "connection_watch.h"
#include "shm_allreduce.h"
#include "types.h"

namespace tnt_gloo {

class Interrupt;  // interruptible.h

// One submitted operation. Shared by the worker (which completes it) and the Python
// handle (which waits on it).
class Work {
 public:
  // Called once by the thread completing the operation, with its error ("" on success),
  // after waiters were woken and holding none of the Work's or the communicator's locks.
  // For the native hand-off (native_comm.h); the Python path passes none.
  using OnDone = std::function<void(const std::string& error)>;

  explicit Work(std::string name, OnDone on_done = nullptr)
      : name_(std::move(name)), on_done_(std::move(on_done)) {}

  const std::string& name() const { return name_; }
  bool done() const;
  // Block until done or `timeout` passed; true if done. Call without the GIL.
  bool wait_for(std::chrono::duration<double> timeout) const;
  // The failure message, empty on success. Only meaningful once done().
  std::string error() const;

  // Record the outcome and wake the waiters; then run the OnDone, if any. Only the first
  // call counts.
  void complete(std::string error);
  // CLOCK_MONOTONIC seconds (Python's time.perf_counter) at completion, or -1 if not done.
  double completion_time() const;

 private:
  const std::string name_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  double completed_at_ = -1.0;
  std::string error_;
  OnDone on_done_;  // taken (under mu_) by the completing call
};

struct ConnectOptions {
  int rank = 0;
  int size = 1;
  std::string hostname;  // address to listen on (used when iface is empty)
  std::string iface;     // network interface to listen on (wins over hostname)
  std::chrono::milliseconds timeout{1800000};
  // Shared-memory allreduce (mode, names, chunk, spin); rank, size and timeout are
  // taken from the fields above.
  ShmOptions shm;
};

// The hierarchical allreduce's parts, for ranks on several hosts holding as many ranks
// each: shared memory among this host's ranks, and a Gloo context over the ranks with
// this rank's local index on every host (one per local index, so that all of a host's
// ranks use the network at once).
struct Hierarchy {
  std::shared_ptr<ShmAllreduce> local;
  std::shared_ptr<gloo::Context> cross;
  HostLayout layout;
  std::uint32_t next_tag = 0;  // of `cross`; used by one thread at a time
};

// What a queued body gets: the context to itself, the timeout, a fresh tag, a
// scratch buffer that only the thread running the body uses (reused between calls), and
// the shared-memory allreduce when all ranks share a host, or the hierarchy's parts
// (both null: Gloo over TCP).
struct Exec {
  const std::shared_ptr<gloo::Context>& context;
  std::chrono::milliseconds timeout;
  std::uint32_t tag;
  std::vector<char>& scratch;
  ShmAllreduce* shm = nullptr;
  Hierarchy* hierarchy = nullptr;
  Interrupt* interrupt = nullptr;  // ends the waits of interruptible.h's algorithms
};

// Synchronous collectives (in place where it applies); they throw on failure.
// run_allreduce uses exec.shm when set, else the hierarchy when set (reduce-scatter
// within the host, `algorithm` over TCP on this rank's slice between the hosts,
// allgather within the host), else `algorithm` over Gloo's TCP transport. Over TCP
// every one of them waits on buffers that exec.interrupt watches (interruptible.h).
void run_allreduce(const Exec& exec, void* data, std::size_t count, DType dtype,
                   ReduceOp op, Algorithm algorithm);
// run_allreduce of the input made of `pieces` times `factor` (fill_gathered, types.h),
// the result in `out`: through exec.shm the pieces go straight into its slots; any other
// way they are gathered into `out` first and reduced there.
void run_allreduce_gather(const Exec& exec, const std::vector<Piece>& pieces, double factor,
                          void* out, std::size_t count, DType dtype, ReduceOp op,
                          Algorithm algorithm);
void run_broadcast(const Exec& exec, void* data, std::size_t nbytes, int root);
void run_allgather(const Exec& exec, const void* in, void* out, std::size_t nbytes);
void run_barrier(const Exec& exec);

class Communicator {
 public:
  // Builds the full mesh through `store` (blocking). Call without the GIL; the store
  // may call back into Python itself.
  Communicator(const ConnectOptions& options, const std::shared_ptr<gloo::rendezvous::Store>& store);
  ~Communicator();

  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // "shm", "hierarchical" or "tcp": what allreduce runs over; the same on every rank.
  const char* allreduce_transport() const {
    return shm_name_.empty() ? "tcp" : hierarchical_ ? "hierarchical" : "shm";
  }
  // "shm", "self" or "tcp": what point-to-point messages to and from `peer` go over.
  std::string p2p_transport(int peer) const;
  // (hosts, ranks per host) of the hierarchical allreduce; (1, size) without it.
  std::pair<int, int> host_layout() const { return host_layout_; }
  // Why shared memory is not used ("" when it is).
  const std::string& shm_reason() const { return shm_reason_; }
  // The (already unlinked) name of this rank's segment, "" without shared memory.
  const std::string& shm_segment_name() const { return shm_name_; }
  // How this rank copies into its shared-memory slots (ShmAllreduce::copy_mode), "" without
  // shared memory or once closed.
  std::string shm_copy() const {
    const auto shm = shm_view_.lock();
    return shm ? shm->copy_mode() : "";
  }

  using Body = std::function<void(const Exec&)>;

  // Queue a collective; `body` runs on the worker, after every earlier submission.
  // Buffers it touches must stay alive until the Work is done (Python keeps them).
  // `inline_ok`: a thread waiting for it may run it itself (see wait); false for bodies
  // with thread-local side effects (cudaSetDevice). `on_done`: see Work::OnDone.
  // Throws GlooError once the communicator is closed or failed; never blocks on the
  // network (it takes the queue's lock only).
  std::shared_ptr<Work> submit(std::string name, Body body, bool inline_ok = true,
                               Work::OnDone on_done = nullptr);

  // The state the worker shares, opaque outside communicator.cpp. A holder that may
  // outlive this object (the native hand-off's capsule, native_comm.h) keeps it and
  // queues through submit_to(), which is submit() on it: same queue, same order, and
  // refused once this communicator is closed. Only the Communicator runs and joins
  // threads (its close(), before it lets go of the state): a holder dropping the last
  // reference later never joins one.
  struct Shared;
  std::shared_ptr<Shared> shared_state() const { return shared_; }
  static std::shared_ptr<Work> submit_to(Shared& shared, std::string name, Body body,
                                         bool inline_ok = true,
                                         Work::OnDone on_done = nullptr);

  // Block until `work` is done or `timeout` passed; true if done. Call without the GIL.
  // May run `work` on the calling thread if it is next and the worker is idle.
  bool wait(const std::shared_ptr<Work>& work, std::chrono::duration<double> timeout);

  // Gloo's own ring (or bcube) allreduce called directly on the calling thread, `iters` times,
  // bypassing the queue; returns the seconds each call took. For the benchmark's
  // baseline, so over TCP even when allreduce uses shared memory, unless `shm` asks for
  // the shared-memory allreduce itself (to tell its cost from the queue's). Waits until
  // the worker is idle and keeps it off the context meanwhile.
  std::vector<double> time_direct_allreduce(void* data, std::size_t count, DType dtype,
                                            Algorithm algorithm, int iters,
                                            bool shm = false);

  // Point-to-point, beside the worker (p2p.h): start sending `nbytes` at `data` to `dest`
  // / receiving the next message from `src` with `tag`. The buffer must stay alive until
  // the Work is done; wait on it with wait(). Throw GlooError once the communicator
  // failed or is closed.
  std::shared_ptr<Work> send(const void* data, std::size_t nbytes, int dest,
                             std::uint64_t tag, std::string name);
  std::shared_ptr<Work> recv(void* data, std::size_t nbytes, int src, std::uint64_t tag,
                             std::string name);
  // The same on the shared state (the native hand-off's holder), with an OnDone; refused
  // (GlooError) once the communicator is closed.
  static std::shared_ptr<Work> send_to(Shared& shared, const void* data, std::size_t nbytes,
                                       int dest, std::uint64_t tag, std::string name,
                                       Work::OnDone on_done);
  static std::shared_ptr<Work> recv_to(Shared& shared, void* data, std::size_t nbytes, int src,
                                       std::uint64_t tag, std::string name,
                                       Work::OnDone on_done);

  // Poison the communicator with `reason` and close its connections.
  void abort(const std::string& reason);
  // The same on the shared state; does nothing more once the communicator is closed.
  static void abort_to(Shared& shared, const std::string& reason);
  // First failure, empty if none.
  std::string failure() const;

  // Stop the worker after the queued operations (at most `grace`, then abort them);
  // close the connections. Idempotent. Returns false if the worker had to be abandoned
  // (it was stuck in a transport call that did not honour the abort).
  bool close(std::chrono::milliseconds grace);

 private:
  struct Task {
    std::shared_ptr<Work> work;
    Body body;
    bool inline_ok = true;
  };
  static void run(std::shared_ptr<Shared> shared);
  static void execute(Shared& shared, Task& task, const std::string& failure);
  static void poison(Shared& shared, const std::string& reason);
  // A ConnectionWatch saw a pair fail (`what`: Gloo's words): poisons the communicator if
  // the operation in flight then does not finish within kConnectionGrace.
  static void connection_failed(Shared& shared, const std::string& what);

  const int rank_;
  const int size_;
  std::shared_ptr<Shared> shared_;
  std::thread worker_;
  std::string shm_reason_;
  std::string shm_name_;
  std::weak_ptr<ShmAllreduce> shm_view_;  // for shm_copy(): the flat or the local one
  bool hierarchical_ = false;
  std::pair<int, int> host_layout_;
  bool closed_ = false;  // close() ran; only close() and the destructor use it
  // One per context (the full mesh; the hierarchy's between the hosts); stopped by close().
  std::vector<std::unique_ptr<ConnectionWatch>> watches_;
};

}  // namespace tnt_gloo
