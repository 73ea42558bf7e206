// The gradient buckets of one bucket plan, reduced through a backend's native table.
//
// TensorFlow-free: the op kernels (tf_ops.cc) copy gradients in with `push`, and take the
// reduced buckets out with `finish`. The plan (which tensor goes where) is made in Python
// by tnt_core.plan_buckets, as for the Python path, so both paths reduce the same buffers
// in the same order.
//
// Per step: every bucket is pushed once (its tensors copied in, scaled by the rank's
// factor), its allreduce starts once it and every bucket numbered before it are complete
// (the same order on every rank), and finish waits for all of them. The buffers finish
// hands out are shared: TensorFlow tensors wrap them without a copy and hold a reference;
// a push that finds its bucket still referenced (a tensor of the last step still alive)
// writes into a fresh buffer instead of under it.
//
// The job's stall ledger (tnt_stall_ledger.h), when given, sees these allreduces as the
// stall inspector sees the Python path's: each takes the next number of the ledger's count
// as it is started, and a finish that blocks marks the wait (the first bucket not back)
// until it has returned, its failure reported included.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tnt_native_comm.h"
#include "tnt_stall_ledger.h"

namespace tnt_keras {

// A 64-byte aligned allocation (TensorFlow wraps aligned memory without copying), zeroed
// unless `zeroed` is false (a receive's: every byte is written before it is read).
class Buffer {
 public:
  explicit Buffer(std::size_t bytes, bool zeroed = true);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  char* data_;
  std::size_t bytes_;
};

struct BucketSpec {
  std::int32_t dtype;  // tnt_native_dtype
  std::int64_t size;   // elements, padding included
};

// What Python is asked, through two C callbacks, at the rare moments that need it.
struct PythonHooks {
  // Once, before the first allreduce: the ranks agree on the plan. 0, or non-zero with a
  // message in err.
  std::int32_t (*agree)(void* arg, char* err, std::int64_t errlen) = nullptr;
  // A failure (from the backend, or a timeout): the message the user sees back in out
  // (Python records it as the process's CommError).
  void (*failed)(void* arg, const char* message, char* out, std::int64_t outlen) = nullptr;
  void* arg = nullptr;
};

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // `ledger` may be null (no stall inspector: one rank, or an unwrapped backend).
  Reducer(const tnt_native_comm* comm, tnt_stall_ledger* ledger, std::vector<BucketSpec> buckets,
          std::int32_t op, bool overlap, double timeout_s, PythonHooks hooks);

  std::size_t num_buckets() const { return buckets_.size(); }
  const BucketSpec& bucket(std::size_t b) const { return buckets_[b]; }

  // Bucket `b`'s input: `srcs[i]` (`counts[i]` elements of the bucket's dtype) at element
  // `offsets[i]`, times `factor`; then start every allreduce that is next in line. Returns
  // "" or the error. With a table that gathers (tnt_native_comm_has_gather) the backend
  // reads the sources itself, copying them once into its transport: `keep` (owning them)
  // is then held until the allreduce is done; else they are copied into the bucket here.
  std::string push(std::size_t b, const std::vector<const void*>& srcs,
                   const std::vector<std::int64_t>& counts,
                   const std::vector<std::int64_t>& offsets, double factor,
                   std::shared_ptr<void> keep = nullptr);

  // Wait for every bucket of the step; their buffers in `out`. Returns "" or the error.
  std::string finish(std::vector<std::shared_ptr<Buffer>>* out);

  // Seconds (CLOCK_MONOTONIC, Python's time.perf_counter) of the last finished step: for
  // each bucket, when it was pushed, when its allreduce started and when it completed.
  std::vector<double> last_times() const;

 private:
  struct Completion {
    std::shared_ptr<Reducer> reducer;
    std::size_t bucket;
    std::shared_ptr<void> keep;  // the gathered sources, released once the allreduce is done
  };
  // A bucket's input as pushed, for a table that gathers.
  struct Pieces {
    std::vector<const void*> srcs;
    std::vector<std::int64_t> counts, offsets;
    double factor = 1.0;
    std::shared_ptr<void> keep;
  };
  static void on_done(void* arg, const char* error);
  void issue_ready();
  std::string agree_once();
  std::string failed(const std::string& message);

  const tnt_native_comm* comm_;
  tnt_stall_ledger* const ledger_;
  const std::vector<BucketSpec> buckets_;
  const std::int32_t op_;
  const bool gather_;  // the table gathers: sources are handed over, not copied here
  const bool overlap_;
  const std::chrono::duration<double> timeout_;
  const PythonHooks hooks_;

  std::mutex agree_mu_;  // held while Python agrees on the plan (first step only)
  bool agreed_ = false;
  std::string agree_error_;
  std::mutex issue_mu_;  // one thread issues at a time, so the order is the bucket order

  mutable std::mutex mu_;  // everything below
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Buffer>> buffers_;
  std::vector<Pieces> pieces_;  // by bucket, while pushed and not yet issued (gather_)
  std::vector<char> pushed_, complete_, done_;
  std::vector<double> pushed_at_, issued_at_, done_at_, last_times_;
  std::vector<std::int64_t> seq_;  // each bucket's number in the stall ledger, this step
  std::size_t next_to_issue_ = 0;
  std::size_t in_flight_ = 0;
  std::string error_;     // of this step (the backend's), reported by finish
  std::string refused_;   // the backend refused an allreduce: reported by finish
  std::string poisoned_;  // set after a failure: every later call fails with it, as it is
};

double monotonic_seconds();

// Marks a wait for collective `seq` in the stall ledger while it lives, unless the ledger
// is absent or already marks one (tnt_stall_ledger.h's rule).
class LedgerWait {
 public:
  LedgerWait(tnt_stall_ledger* ledger, std::int64_t seq);
  ~LedgerWait();
  LedgerWait(const LedgerWait&) = delete;
  LedgerWait& operator=(const LedgerWait&) = delete;

 private:
  tnt_stall_ledger* ledger_;  // null: nothing to clear
};

}  // namespace tnt_keras
