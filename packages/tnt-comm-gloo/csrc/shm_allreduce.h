// Allreduce through POSIX shared memory, for jobs whose ranks all run on one host, and
// the intra-host steps of the hierarchical allreduce (ranks on several hosts).
//
// Gloo's only transport here is TCP, which over loopback costs ~230 µs for 4 KiB and
// ~0.5 GB/s for large buffers on a small VM; plain loads and stores through a shared
// mapping cost a few µs and run at memory speed. Each rank owns one segment (a control
// block and two chunk-sized data slots) that every rank maps. The worker thread calls
// ShmAllreduce::allreduce in place of Gloo's algorithms, so ordering with the other
// collectives (still over TCP) is the queue's.
//
// Waiting never burns a core: a short spin, then a futex on the peer's sequence word
// (shared, not FUTEX_PRIVATE: it is another process's memory), woken by the publisher
// only when a waiter announced itself. Sleeps are sliced so a waiter notices the
// operation deadline, a peer that exited, and a peer's abort flag (set when its
// communicator is poisoned or closed).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "shm_ring.h"
#include "types.h"

namespace tnt_gloo {

enum class ShmMode : std::uint8_t { kOff, kAuto, kRequired };

// How a rank copies its data into its slots. kStream: non-temporal stores, past the
// caches (the peers read it from memory); kCache: memcpy (the peers take the lines from
// this core's cache). Which is faster is a property of the host: non-temporal stores were
// 3-10x faster on one VM (the caches' way at times ran at 1.3 GB/s), memcpy 3x faster on
// another. kAuto times both on this rank's first large copies and keeps the faster.
enum class ShmCopy : std::uint8_t { kAuto, kStream, kCache };

struct ShmOptions {
  ShmMode mode = ShmMode::kAuto;
  int rank = 0;
  int size = 1;
  // Segment names start with "/" + prefix (job-specific, so names of different jobs
  // never meet and leftovers are attributable); a random token makes them unique.
  std::string name_prefix = "tnt-gloo-";
  // This rank's host identity; empty: host name + kernel boot id.
  std::string host_id;
  // The hierarchical allreduce when the ranks are on several hosts (see setup_shm).
  ShmMode hierarchy = ShmMode::kAuto;
  std::size_t chunk_bytes = 256 << 10;
  // Spin this long before sleeping on the futex; < 0: the default (50 µs).
  int spin_us = -1;
  ShmCopy copy = ShmCopy::kAuto;
  std::chrono::milliseconds timeout{1800000};
};

class ShmAllreduce;

// Where the ranks are, when the hierarchical allreduce runs: `hosts` hosts (numbered in
// the order of their lowest rank) holding `local_size` ranks each; this rank is local
// rank `local_rank` (by global rank) on host `host_index`.
struct HostLayout {
  int hosts = 1;
  int host_index = 0;
  int local_size = 1;
  int local_rank = 0;
  std::vector<int> local_ranks;  // the global ranks on this host, by local rank
  std::vector<int> cross_ranks;  // the global ranks with this local rank, by host index
};

struct ShmSetup {
  // null: the job keeps Gloo's TCP algorithms. Spans this host's ranks only when
  // `hierarchical`, else every rank.
  std::shared_ptr<ShmAllreduce> shm;
  std::string reason;  // why not; the same text on every rank
  bool hierarchical = false;
  HostLayout layout;   // meaningful when hierarchical
};

// Collective: every rank of the communicator calls it, whatever its mode. Exchanges
// modes and host identities through `store`, creates and maps the segments, and agrees:
// either all ranks get a ShmAllreduce or none does (reason says why, the same text on
// every rank). On several hosts holding the same number (>= 2) of ranks each, and no
// rank's hierarchy mode off, every rank gets one over the ranks of its host and
// `hierarchical`; other layouts of several hosts get none. Throws only when the store
// itself fails.
ShmSetup setup_shm(const ShmOptions& options, gloo::rendezvous::Store& store);

class ShmAllreduce {
 public:
  enum AbortKind : std::uint32_t { kNotAborted = 0, kFailed = 1, kClosed = 2 };

  struct Segment;  // one mapped segment (ours or a peer's)
  // How to tell whether a peer's process still exists. kill(pid, 0) is not enough: a
  // peer that exited stays a zombie until its launcher reaps it, and pids are reused.
  struct Peer {
    long pid = 0;
    int pidfd = -1;         // pidfd_open(2): readable once the process has exited
    bool verified = false;  // pid checked against the peer's start time (same pid namespace)
    unsigned long long start_time = 0;
  };

  // options.rank and options.size: this rank among the segments' ranks; `names`: the
  // communicator's rank of each, for messages.
  ShmAllreduce(const ShmOptions& options, std::vector<std::unique_ptr<Segment>> segments,
               std::vector<Peer> peers, std::vector<int> names);
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  // Reduce `count` elements at `data` in place over all ranks; one thread at a time
  // (the communicator's context lock). Throws GlooError naming the peer on timeout, peer
  // exit or peer abort; after that the object must not be used again (the communicator
  // is poisoned anyway).
  void allreduce(void* data, std::size_t count, DType dtype, ReduceOp op,
                 std::chrono::milliseconds timeout);
  // The same, its input gathered from `pieces` times `factor` (fill_gathered, types.h)
  // straight into this rank's slots, the result in `out` (`count` elements): the copy a
  // caller would make into one buffer first is the slot's copy.
  void allreduce_gather(const std::vector<Piece>& pieces, double factor, void* out,
                        std::size_t count, DType dtype, ReduceOp op,
                        std::chrono::milliseconds timeout);

  // The hierarchical allreduce's intra-host steps. The buffer is cut into size()
  // contiguous slices (slice(count, size(), r)); reduce_scatter leaves in slice rank()
  // of `data` the reduction of that slice over the ranks, in rank order (the rest of
  // `data` is left as it was); allgather copies every rank's slice into the others'
  // `data`. Both fail as allreduce does, at `deadline` at the latest (`timeout` is for
  // the message).
  void reduce_scatter(void* data, std::size_t count, DType dtype, ReduceOp op,
                      std::chrono::milliseconds timeout,
                      std::chrono::steady_clock::time_point deadline);
  void allgather(void* data, std::size_t count, DType dtype, std::chrono::milliseconds timeout,
                 std::chrono::steady_clock::time_point deadline);
  // [first, last) elements of slice `index` of `parts`: the first count % parts slices
  // are one element longer; slices of a buffer shorter than `parts` may be empty.
  static std::pair<std::size_t, std::size_t> slice(std::size_t count, int parts, int index);
  int rank() const { return rank_; }
  int size() const { return size_; }

  // What makes the operation in progress fail, "" if nothing: an abort flag (this
  // rank's or a peer's) or a peer that exited. For a thread that waits on something else
  // in the middle of an operation (the hierarchical allreduce waiting for its exchange
  // between the hosts), so that a local failure ends that wait too.
  std::string failure();

  // Tell the peers (and our own waiting thread) to give up: sets this rank's abort flag
  // and wakes every sleeper on every segment. Any thread, any time; idempotent.
  void abort(AbortKind kind) noexcept;

  // Point-to-point between the ranks of the group (p2p.h): the group's index of a rank of
  // the communicator (-1 if it is not in the group), the ring from `from` into `to`
  // (indices of the group), and what ended `peer` ("" if it is still there: not exited,
  // not closed, not failed). Any thread.
  int local_of(int comm_rank) const;
  ShmRing ring(int from, int to) const;
  std::string peer_gone(int peer) const;
  std::chrono::nanoseconds spin() const { return spin_; }

  // The name this rank's segment had (already unlinked): for tests and diagnostics.
  const std::string& segment_name() const { return own_name_; }
  std::size_t chunk_bytes() const { return chunk_bytes_; }
  // "stream" or "cache": how this rank copies into its slots; "auto" while it is still
  // timing both (ShmCopy). Any thread.
  const char* copy_mode() const;

 private:
  // Writes elements [first, first + n) of this rank's input into a slot's chunk.
  using Fill = std::function<void(char* slot_chunk, std::size_t first, std::size_t n)>;
  // allreduce's chunks; `fill` null: the input is `data` itself, reduced in place.
  void run(void* data, std::size_t count, DType dtype, ReduceOp op,
           std::chrono::milliseconds timeout, const Fill* fill);
  void publish(std::uint32_t value);
  void wait_for_peer(int peer, std::uint32_t target,
                     std::chrono::steady_clock::time_point deadline,
                     std::chrono::milliseconds timeout);
  // What stops the wait for `waiting_for` (an abort flag, an exited peer, the deadline),
  // "" if nothing does; `liveness`: look for exited peers even without a flag.
  std::string check_peers(int waiting_for, std::chrono::milliseconds timeout,
                          std::chrono::steady_clock::time_point deadline, bool liveness);
  char* slot(int rank, unsigned index) const;
  // Copy into a slot the way copy_ says; while it says kAuto, time the large copies, the
  // two ways in turn, and settle on the faster (see copy_mode).
  void copy_in(void* dst, const void* src, std::size_t bytes);
  // The same for `n` elements of `src` times `factor` (scale_copy's result): a gradient
  // of a mean loss reaches its slot this way, scaled by the rank's share of the batch.
  void scale_in(void* dst, const void* src, std::size_t n, double factor, DType dtype);
  // Write `bytes` into a slot by `stream()` (past the caches) or `cached()` (plain stores),
  // as copy_ says, timing the two in turn while it says kAuto (copy_in, scale_in).
  template <typename Stream, typename Cached>
  void write_slot(std::size_t bytes, Stream&& stream, Cached&& cached);
  // One pass over the slices, a piece of every slice per chunk (see reduce_scatter).
  void slices(bool reduce, void* data, std::size_t count, DType dtype, ReduceOp op,
              std::chrono::milliseconds timeout,
              std::chrono::steady_clock::time_point deadline);

  const int rank_;
  const int size_;
  const std::size_t chunk_bytes_;
  const std::chrono::nanoseconds spin_;
  const long owner_pid_;
  std::string own_name_;
  std::vector<std::unique_ptr<Segment>> segments_;  // by rank
  std::vector<Peer> peers_;                         // by rank (ours unused)
  std::vector<int> names_;                          // by rank: the communicator's rank
  // 3 per chunk of allreduce, 1 per chunk of the slice steps, across operations; the
  // same on every rank
  std::uint32_t next_seq_ = 0;
  std::uint64_t next_chunk_ = 0;  // picks the slot: chunks alternate between the two
  std::atomic<ShmCopy> copy_;
  // kAuto's timings, ns per byte: [0] non-temporal stores, [1] memcpy; and the large
  // copies made so far while timing (the first ones, which touch fresh pages, are not kept)
  std::vector<double> timed_[2];
  std::uint32_t timed_copies_ = 0;
};

}  // namespace tnt_gloo
