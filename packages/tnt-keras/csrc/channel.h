// Sends and receives through a backend's native table (tnt_native_comm.h, ABI 2): what the
// TntSend, TntRecv and TntWaitSends kernels (tf_ops.cc) call.
//
// TensorFlow-free, as the reducer is. A send starts and returns a token at once; the bytes
// it reads stay alive (the kernel hands a release that drops its tensor) until the backend
// is done with them. A receive blocks its caller until the message is there, the peer is
// known dead, or TNT_TIMEOUT_S passed; it lands in a Buffer of its own that the kernel's
// output tensor wraps without a copy, and that stays alive until the backend is done with
// it even when the wait gave up (the backend may still write there until then).
//
// Failures: the backend's (a dead peer, a size mismatch, a closed or failed communicator)
// and a timeout go through the Python hook that makes them the process's CommError. A
// timed-out receive aborts the communicator (the table's abort), as a timed-out wait of the
// Python path does: the message it gave up on cannot be matched any more.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "reducer.h"
#include "tnt_native_comm.h"

namespace tnt_keras {

class Channel : public std::enable_shared_from_this<Channel> {
 public:
  // `comm` must have point-to-point (tnt_native_comm_has_p2p); `hooks.failed` words a
  // failure as the user sees it (hooks.agree is not used).
  Channel(const tnt_native_comm* comm, double timeout_s, PythonHooks hooks);

  // Start sending `nbytes` at `data` to `peer` with `tag`. `release` runs exactly once, when
  // the backend no longer reads `data` (at once if the send is refused). Returns "" with the
  // send's token in `token`, or the error.
  std::string send(const void* data, std::int64_t nbytes, std::int32_t peer, std::int64_t tag,
                   std::function<void()> release, std::int64_t* token);

  // Receive the next message from `peer` with `tag` into `buffer` (its whole size), blocking
  // until it is there or failed. Returns "" or the error.
  std::string recv(const std::shared_ptr<Buffer>& buffer, std::int32_t peer, std::int64_t tag);

  // Block until the sends of `tokens` are done (up to TNT_TIMEOUT_S). Returns "" or the
  // first of their errors.
  std::string wait_sends(const std::vector<std::int64_t>& tokens);

  std::int32_t rank() const { return comm_->rank; }

  // Seconds receives and waits for sends have spent blocked since the channel was made
  // (what a stage's step waited for its neighbours: the pipeline benchmark reads it).
  double waited_s() const { return static_cast<double>(waited_ns_.load()) * 1e-9; }

 private:
  struct SendDone;
  struct RecvDone;
  static void on_send_done(void* arg, const char* error);
  static void on_recv_done(void* arg, const char* error);
  std::string failed(const std::string& message);

  const tnt_native_comm* comm_;
  const std::chrono::duration<double> timeout_;
  const PythonHooks hooks_;

  std::mutex mu_;  // everything below, and every RecvDone's state
  // one for each direction: a send completing wakes no receive waiting on its message
  std::condition_variable send_cv_, recv_cv_;
  std::int64_t next_token_ = 1;
  std::set<std::int64_t> sending_;                 // tokens of sends not done yet
  std::atomic<std::int64_t> waited_ns_{0};
  std::map<std::int64_t, std::string> send_errors_;  // tokens of sends that failed
};

}  // namespace tnt_keras
