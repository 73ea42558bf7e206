#include "native_comm.h"

#include <algorithm>
#include <atomic>
#include <vector>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "errors.h"

namespace tnt_gloo {
namespace {

struct NativeComm {
  // First member: the capsule's pointer is &table (its `self` leads back here).
  tnt_native_comm table{};
  std::shared_ptr<Communicator::Shared> shared;
  std::vector<AlgorithmStep> plan;
  int rank = 0;
  // numbers the accepted allreduces, as the Python layer numbers its operations
  std::atomic<std::uint64_t> issued{0};
  // numbers the accepted sends and receives (one count for both)
  std::atomic<std::uint64_t> messages{0};
};

// Write `message` into the caller's `err` (truncated, NUL-terminated) and return the
// refusal code.
std::int32_t refuse(char* err, std::int64_t errlen, const std::string& message) noexcept {
  if (err != nullptr && errlen > 0) {
    const std::size_t n =
        std::min<std::size_t>(message.size(), static_cast<std::size_t>(errlen - 1));
    std::memcpy(err, message.data(), n);
    err[n] = '\0';
  }
  return 1;
}

// tnt_native_dtype (tnt_core.SUPPORTED_DTYPES numbered from 1) to ours; false if unknown.
bool dtype_of(std::int32_t code, DType* out) {
  switch (code) {
    case TNT_NATIVE_FLOAT16: *out = DType::kFloat16; return true;
    case TNT_NATIVE_FLOAT32: *out = DType::kFloat32; return true;
    case TNT_NATIVE_FLOAT64: *out = DType::kFloat64; return true;
    case TNT_NATIVE_INT32: *out = DType::kInt32; return true;
    case TNT_NATIVE_INT64: *out = DType::kInt64; return true;
    default: return false;
  }
}

// tnt_native_op (tnt_core.REDUCE_OPS numbered from 0) to ours; false if unknown.
bool op_of(std::int32_t code, ReduceOp* out) {
  switch (code) {
    case TNT_NATIVE_SUM: *out = ReduceOp::kSum; return true;
    case TNT_NATIVE_MIN: *out = ReduceOp::kMin; return true;
    case TNT_NATIVE_MAX: *out = ReduceOp::kMax; return true;
    case TNT_NATIVE_PRODUCT: *out = ReduceOp::kProduct; return true;
    default: return false;
  }
}

Algorithm algorithm_for(const std::vector<AlgorithmStep>& plan, std::uint64_t nbytes) {
  for (const AlgorithmStep& step : plan) {
    if (nbytes <= step.max_bytes) return step.algorithm;
  }
  return plan.back().algorithm;
}

// The operation's name in errors, as the Python layer names its own ("allreduce #7"),
// with a numbering of its own: "[rank 0: native allreduce #3] ".
std::string prefix(int rank, const std::string& operation) {
  return "[rank " + std::to_string(rank) + ": " + operation + "] ";
}

// The OnDone of an operation accepted through the table: `done(arg, NULL)`, or the error
// after `head` (the operation's name); the message lives during the call only.
Work::OnDone done_caller(tnt_native_done_fn done, void* arg, std::string head,
                         const char* what) {
  return [done, arg, head = std::move(head), what](const std::string& error) {
    if (error.empty()) {
      done(arg, nullptr);
      return;
    }
    std::string message;
    try {
      message = head + error;
    } catch (...) {  // out of memory: a failure without its details, but a failure
      done(arg, what);
      return;
    }
    done(arg, message.c_str());
  };
}

// Why an allreduce's arguments are refused ("" if they are not): its callback, codes,
// count and `buffer` (named `name` in the reason); the codes decoded into `dt` and `rop`.
std::string check_reduction(tnt_native_done_fn done, std::int32_t dtype, std::int32_t op,
                            std::int64_t count, const void* buffer, const char* name, DType* dt,
                            ReduceOp* rop) {
  if (done == nullptr) return "no done callback was given";
  if (!dtype_of(dtype, dt)) {
    return "unknown element type " + std::to_string(dtype) + " (tnt_native_dtype: 1 to 5)";
  }
  if (!op_of(op, rop)) return "unknown reduction " + std::to_string(op) + " (tnt_native_op: 0 to 3)";
  const auto most = static_cast<std::int64_t>(std::numeric_limits<std::int64_t>::max() /
                                              static_cast<std::int64_t>(element_size(*dt)));
  if (count < 0 || count > most) return "element count " + std::to_string(count) + " is out of range";
  if (buffer == nullptr && count > 0) return std::string(name) + " is NULL";
  return "";
}

// The two allreduce entries' shared part: `check(&nbytes)` returns why the arguments are
// refused ("" if they are not) and the bytes reduced; `task(algorithm)` makes the worker's
// work; then the operation's number, its done caller, the queue, and the refusals' wording.
template <typename Check, typename Task>
std::int32_t submit_allreduce(void* self, tnt_native_done_fn done, void* arg, char* err,
                              std::int64_t errlen, Check check, Task task) noexcept {
  auto* nc = static_cast<NativeComm*>(self);
  if (nc == nullptr) return refuse(err, errlen, "native allreduce: self is NULL");
  std::string operation = "native allreduce";
  try {
    std::uint64_t nbytes = 0;
    const std::string why = check(&nbytes);
    if (!why.empty()) return refuse(err, errlen, prefix(nc->rank, operation) + why);
    const Algorithm algorithm = algorithm_for(nc->plan, nbytes);
    operation += " #" + std::to_string(nc->issued.fetch_add(1) + 1);
    // on_done runs on the worker, once
    Work::OnDone on_done =
        done_caller(done, arg, prefix(nc->rank, operation),
                    "native allreduce failed (and describing why ran out of memory)");
    Communicator::submit_to(*nc->shared, operation, task(algorithm), /*inline_ok=*/true,
                            std::move(on_done));
    return 0;
  } catch (...) {  // refused by the queue (closed, failed) or out of memory
    return refuse(err, errlen,
                  prefix(nc->rank, operation) + describe_exception(std::current_exception()));
  }
}

std::int32_t allreduce_async(void* self, void* data, std::int64_t count, std::int32_t dtype,
                             std::int32_t op, tnt_native_done_fn done, void* arg, char* err,
                             std::int64_t errlen) noexcept {
  DType dt{};
  ReduceOp rop{};
  const auto n = static_cast<std::size_t>(count);
  return submit_allreduce(
      self, done, arg, err, errlen,
      [&](std::uint64_t* nbytes) {
        std::string why = check_reduction(done, dtype, op, count, data, "data", &dt, &rop);
        if (why.empty()) *nbytes = static_cast<std::uint64_t>(n * element_size(dt));
        return why;
      },
      [&](Algorithm algorithm) {
        return [data, n, dt, rop, algorithm](const Exec& exec) {
          run_allreduce(exec, data, n, dt, rop, algorithm);
        };
      });
}

// The pieces of an allreduce_gather_async, checked (within `count`, not overlapping) and
// sorted by offset into `pieces`; returns why they are refused, "" if they are not.
std::string gathered_pieces(const void* const* srcs, const std::int64_t* counts,
                            const std::int64_t* offsets, std::int32_t nparts, std::int64_t count,
                            std::vector<Piece>* pieces) {
  if (nparts < 0 || (nparts > 0 && (srcs == nullptr || counts == nullptr || offsets == nullptr))) {
    return "the pieces are not given (nparts " + std::to_string(nparts) + ")";
  }
  pieces->reserve(static_cast<std::size_t>(nparts));
  for (std::int32_t i = 0; i < nparts; ++i) {
    if (counts[i] < 0 || offsets[i] < 0 || offsets[i] > count - counts[i] ||
        (srcs[i] == nullptr && counts[i] > 0)) {
      return "piece " + std::to_string(i) + " (" + std::to_string(counts[i]) +
             " elements at offset " + std::to_string(offsets[i]) + ") does not fit " +
             std::to_string(count) + " elements";
    }
    pieces->push_back({srcs[i], static_cast<std::size_t>(offsets[i]),
                       static_cast<std::size_t>(counts[i])});
  }
  std::sort(pieces->begin(), pieces->end(),
            [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
  for (std::size_t i = 1; i < pieces->size(); ++i) {
    if ((*pieces)[i - 1].offset + (*pieces)[i - 1].count > (*pieces)[i].offset) {
      return "two pieces overlap at element " + std::to_string((*pieces)[i].offset);
    }
  }
  return "";
}

std::int32_t allreduce_gather_async(void* self, const void* const* srcs,
                                    const std::int64_t* counts, const std::int64_t* offsets,
                                    std::int32_t nparts, double factor, void* out,
                                    std::int64_t count, std::int32_t dtype, std::int32_t op,
                                    tnt_native_done_fn done, void* arg, char* err,
                                    std::int64_t errlen) noexcept {
  DType dt{};
  ReduceOp rop{};
  std::vector<Piece> pieces;
  const auto n = static_cast<std::size_t>(count);
  return submit_allreduce(
      self, done, arg, err, errlen,
      [&](std::uint64_t* nbytes) {
        std::string why = check_reduction(done, dtype, op, count, out, "out", &dt, &rop);
        if (why.empty()) why = gathered_pieces(srcs, counts, offsets, nparts, count, &pieces);
        if (why.empty()) *nbytes = static_cast<std::uint64_t>(n * element_size(dt));
        return why;
      },
      [&](Algorithm algorithm) {
        return [pieces = std::move(pieces), factor, out, n, dt, rop, algorithm](const Exec& exec) {
          run_allreduce_gather(exec, pieces, factor, out, n, dt, rop, algorithm);
        };
      });
}

// send_async and recv_async: the checks, then the communicator's point-to-point (p2p.h),
// beside the collective worker as the Python methods' messages are.
std::int32_t p2p_async(void* self, bool send, void* data, std::int64_t nbytes,
                       std::int32_t peer, std::int64_t tag, tnt_native_done_fn done, void* arg,
                       char* err, std::int64_t errlen) noexcept {
  auto* nc = static_cast<NativeComm*>(self);
  const char* kind = send ? "native send" : "native recv";
  if (nc == nullptr) return refuse(err, errlen, std::string(kind) + ": self is NULL");
  std::string operation = kind;
  try {
    operation += std::string(send ? " to " : " from ") + std::to_string(peer) + " tag " +
                 std::to_string(tag);
    if (done == nullptr) {
      return refuse(err, errlen, prefix(nc->rank, operation) + "no done callback was given");
    }
    if (peer < 0 || peer >= nc->table.size) {
      return refuse(err, errlen, prefix(nc->rank, operation) + "rank " + std::to_string(peer) +
                                     " is not a rank of this communicator (0.." +
                                     std::to_string(nc->table.size - 1) + ")");
    }
    if (tag < 0 || tag > TNT_NATIVE_MAX_TAG) {
      return refuse(err, errlen, prefix(nc->rank, operation) + "tag " + std::to_string(tag) +
                                     " is out of range (0 to TNT_NATIVE_MAX_TAG)");
    }
    if (nbytes < 0) {
      return refuse(err, errlen, prefix(nc->rank, operation) + "byte count " +
                                     std::to_string(nbytes) + " is negative");
    }
    if (data == nullptr && nbytes > 0) {
      return refuse(err, errlen, prefix(nc->rank, operation) + "data is NULL");
    }
    operation += " #" + std::to_string(nc->messages.fetch_add(1) + 1);
    Work::OnDone on_done = done_caller(done, arg, prefix(nc->rank, operation),
                                       send ? "native send failed (and describing why ran "
                                              "out of memory)"
                                            : "native recv failed (and describing why ran "
                                              "out of memory)");
    const auto n = static_cast<std::size_t>(nbytes);
    const auto t = static_cast<std::uint64_t>(tag);
    if (send) {
      Communicator::send_to(*nc->shared, data, n, peer, t, operation, std::move(on_done));
    } else {
      Communicator::recv_to(*nc->shared, data, n, peer, t, operation, std::move(on_done));
    }
    return 0;
  } catch (...) {  // refused: closed or failed communicator, a peer known gone, no memory
    return refuse(err, errlen,
                  prefix(nc->rank, operation) + describe_exception(std::current_exception()));
  }
}

std::int32_t send_async(void* self, const void* data, std::int64_t nbytes, std::int32_t peer,
                        std::int64_t tag, tnt_native_done_fn done, void* arg, char* err,
                        std::int64_t errlen) noexcept {
  return p2p_async(self, /*send=*/true, const_cast<void*>(data), nbytes, peer, tag, done, arg,
                   err, errlen);
}

std::int32_t recv_async(void* self, void* data, std::int64_t nbytes, std::int32_t peer,
                        std::int64_t tag, tnt_native_done_fn done, void* arg, char* err,
                        std::int64_t errlen) noexcept {
  return p2p_async(self, /*send=*/false, data, nbytes, peer, tag, done, arg, err, errlen);
}

void abort_comm(void* self, const char* reason) noexcept {
  auto* nc = static_cast<NativeComm*>(self);
  if (nc == nullptr) return;
  try {
    Communicator::abort_to(*nc->shared, reason != nullptr && reason[0] != '\0'
                                            ? std::string(reason)
                                            : std::string("aborted through the native table"));
  } catch (...) {  // out of memory: nothing more can be done from here
  }
}

}  // namespace

tnt_native_comm* make_native_comm(const Communicator& comm, std::vector<AlgorithmStep> plan) {
  if (plan.empty()) throw std::invalid_argument("the native table needs an algorithm plan");
  auto nc = std::make_unique<NativeComm>();
  nc->shared = comm.shared_state();
  nc->plan = std::move(plan);
  nc->rank = comm.rank();
  nc->table.abi_version = TNT_NATIVE_COMM_ABI_VERSION;
  nc->table.struct_size = sizeof(tnt_native_comm);
  nc->table.rank = comm.rank();
  nc->table.size = comm.size();
  nc->table.allreduce_async = &allreduce_async;
  nc->table.send_async = &send_async;
  nc->table.recv_async = &recv_async;
  nc->table.abort = &abort_comm;
  nc->table.allreduce_gather_async = &allreduce_gather_async;
  NativeComm* raw = nc.release();
  raw->table.self = raw;
  return &raw->table;
}

void free_native_comm(void* table) noexcept {
  if (table == nullptr) return;
  delete static_cast<NativeComm*>(static_cast<tnt_native_comm*>(table)->self);
}

}  // namespace tnt_gloo
