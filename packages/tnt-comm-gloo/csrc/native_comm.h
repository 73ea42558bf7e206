// The native hand-off (tnt_core/include/tnt_native_comm.h, ABI 2): the C function table
// through which compiled framework ops start allreduces, sends and receives on this
// communicator with no Python and no GIL.
//
// Its send_async and recv_async are the Python methods' point-to-point (p2p.h): posted
// from the caller's thread, completed by the per-peer threads, on the same (peer, tag)
// streams, on Gloo slots apart from every collective's. Its abort poisons the
// communicator as a timed-out Python wait does.
//
// Its allreduce_async queues on the communicator's one worker queue (Communicator::
// submit_to), as the Python path's allreduce does, with the same allreduce (shared
// memory when the communicator uses it, else the TCP algorithm the Python layer's plan
// gives for the buffer's size): collectives issued through the table and through Python
// go out in the one order they were issued in. The table owns a reference to the
// communicator's shared state, never the Communicator itself: once the communicator is
// closed the table refuses, and dropping it never joins a thread.
#pragma once

#include <cstdint>
#include <vector>

#include <tnt_native_comm.h>

#include "communicator.h"
#include "types.h"

namespace tnt_gloo {

// Buffers of at most `max_bytes` bytes take `algorithm` (the first step that fits; larger
// buffers than every step's take the last one). The Python layer's
// GlooSettings.algorithm_plan(), so the choice is the Python path's.
struct AlgorithmStep {
  std::uint64_t max_bytes;
  Algorithm algorithm;
};

// A table for `comm` (plan must not be empty), on the heap; free it with
// free_native_comm (the capsule's destructor). Its `self` is the owning object.
tnt_native_comm* make_native_comm(const Communicator& comm, std::vector<AlgorithmStep> plan);
void free_native_comm(void* table) noexcept;

}  // namespace tnt_gloo
