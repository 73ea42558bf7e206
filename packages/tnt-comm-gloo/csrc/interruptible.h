// Allreduce algorithms over Gloo's unbound buffers whose waits another thread can end.
//
// Closing a Gloo context's connections breaks the peers' waits on this rank, but none of
// this rank's own: Gloo's Pair::close() signals no pending operation, and the buffers of
// Gloo's own collectives are out of reach. The hierarchical allreduce runs the exchange
// between the hosts on a helper thread while its caller works through shared memory; when
// the caller fails (a rank of its host exited), the helper, blocked on a peer of another
// host, would otherwise wait until the operation's timeout before it can be joined. Its
// algorithms therefore wait on buffers of their own, watched by an Interrupt whose fire()
// ends those waits (Gloo's abortWaitRecv/abortWaitSend), in the middle of a message too.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <mutex>
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

  // End the current and every later wait on a watched buffer; idempotent. Call after the
  // buffers' connections are closed, so that Gloo can no longer write into them.
  void fire() noexcept;

 private:
  std::mutex mu_;
  bool fired_ = false;
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

}  // namespace tnt_gloo
