// Collectives over Gloo's unbound buffers whose waits another thread can end.
//
// Closing a Gloo context's connections breaks the peers' waits on this rank, but none of
// this rank's own: Gloo's Pair::close() signals no pending operation, and the buffers of
// Gloo's own collectives are out of reach. A peer whose link went down sends nothing and
// breaks nothing either: TCP keeps retransmitting for many minutes. So a rank waiting on
// it in one of Gloo's collectives waits until the operation's timeout, even after the job
// decided that the peer is lost (an elastic job's new generation aborts the communicator)
// or a rank of its own host failed (the hierarchical allreduce's helper thread, blocked
// between the hosts). Every collective the communicator runs over TCP therefore waits on
// buffers of its own, watched by an Interrupt whose fire() ends those waits (Gloo's
// abortWaitRecv/abortWaitSend), in the middle of a message too. (Gloo's own collectives
// remain only as the benchmark's baseline.)
#pragma once

#include <cstddef>
#include <initializer_list>
#include <mutex>
#include <string>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/transport/unbound_buffer.h>

#include "communicator.h"

namespace tnt_gloo {

class Interrupt {
 public:
  // Watches `buffers` while it lives: fire() ends their waits. Throws GlooError if the
  // interrupt already fired. A null interrupt watches nothing.
  class Watch {
   public:
    Watch(Interrupt* interrupt, std::initializer_list<gloo::transport::UnboundBuffer*> buffers);
    ~Watch();
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    Interrupt* const interrupt_;
    std::vector<gloo::transport::UnboundBuffer*> buffers_;
  };

  // End the current and every later wait on a watched buffer, which then fails saying
  // `reason` (the first one given); idempotent. Call after the buffers' connections are
  // closed, so that Gloo can no longer write into them.
  void fire(const std::string& reason) noexcept;
  // Why it fired ("" before).
  std::string reason();

 private:
  std::mutex mu_;
  bool fired_ = false;
  std::string reason_;
  std::vector<gloo::transport::UnboundBuffer*> watched_;
};

using ReduceFunc = gloo::AllreduceOptions::Func;

// Recursive doubling: in step k every rank swaps its whole (partially reduced) buffer with
// rank ^ 2^k and combines the two, the lower rank's data always first, so every rank ends
// with bitwise the same result. log2(p) exchanges against bcube's 2 log2(p): the fastest
// for buffers small enough that latency, not bandwidth, decides. Power-of-two groups only.
void allreduce_doubling(const Exec& exec, void* data, std::size_t count, std::size_t elsize,
                        const ReduceFunc& reduce);

// Ring: p - 1 steps of reduce-scatter (each rank sends one slice to its right neighbour
// and adds the one from its left into its own), then p - 1 steps of allgather. Every
// rank sends 2 (p - 1) / p of the buffer: bandwidth-optimal. Each slice is reduced by one
// rank and copied to the others, so every rank ends with bitwise the same result.
void allreduce_ring(const Exec& exec, void* data, std::size_t count, std::size_t elsize,
                    const ReduceFunc& reduce);

// Recursive halving, then doubling (Gloo's bcube with base 2, Rabenseifner's algorithm):
// log2(p) steps of reduce-scatter, each swapping half of what is left with rank ^ 2^k,
// then log2(p) steps of allgather in reverse. 2 log2(p) steps and 2n(p - 1)/p bytes
// sent: fewer steps than the ring, fewer bytes than recursive doubling. On p ranks that
// are not a power of two, the first 2r (r = p - 2^k) fold in pairs first (the even one
// sends its buffer to the odd one, which takes part for both) and get the result back
// last: two more steps of the whole buffer. Each element is reduced by one rank and
// copied to the others, so every rank ends with bitwise the same result.
void allreduce_halving_doubling(const Exec& exec, void* data, std::size_t count,
                                std::size_t elsize, const ReduceFunc& reduce);

// Broadcast from `root` along a binomial tree (ranks counted from the root): a rank
// receives the whole buffer once, then passes it on to up to log2(p) others, the farthest
// first. ceil(log2 p) rounds.
void broadcast_tree(const Exec& exec, void* data, std::size_t nbytes, int root);

// Allgather along the ring: `out` holds p blocks of `nbytes`, this rank's copied from `in`
// first; in each of p - 1 steps every rank passes the block it got last to its right
// neighbour.
void allgather_ring(const Exec& exec, const void* in, void* out, std::size_t nbytes);

// Dissemination barrier: in round k every rank signals rank + 2^k and waits for rank - 2^k;
// after ceil(log2 p) rounds every rank has heard, indirectly, from every other.
void barrier_dissemination(const Exec& exec);

}  // namespace tnt_gloo
