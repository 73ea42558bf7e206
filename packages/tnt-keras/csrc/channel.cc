#include "channel.h"

#include <chrono>
#include <sstream>
#include <utility>

namespace tnt_keras {

struct Channel::SendDone {
  std::shared_ptr<Channel> channel;
  std::int64_t token;
  std::function<void()> release;
};

// A receive's outcome; its buffer stays here until the backend called done.
struct Channel::RecvDone {
  std::shared_ptr<Channel> channel;
  std::shared_ptr<Buffer> buffer;
  bool done = false;
  std::string error;
};

Channel::Channel(const tnt_native_comm* comm, double timeout_s, PythonHooks hooks)
    : comm_(comm), timeout_(timeout_s > 0 ? timeout_s : 1e9), hooks_(hooks) {}

std::string Channel::failed(const std::string& message) {
  if (hooks_.failed == nullptr) return message;
  char out[4096] = {0};
  hooks_.failed(hooks_.arg, message.c_str(), out, sizeof(out));
  return out[0] ? std::string(out) : message;
}

std::string Channel::send(const void* data, std::int64_t nbytes, std::int32_t peer,
                          std::int64_t tag, std::function<void()> release, std::int64_t* token) {
  std::int64_t mine;
  {
    std::lock_guard<std::mutex> lock(mu_);
    mine = next_token_++;
    sending_.insert(mine);
  }
  auto* completion = new SendDone{shared_from_this(), mine, std::move(release)};
  char err[1024] = {0};
  const std::int32_t rc = comm_->send_async(comm_->self, data, nbytes, peer, tag,
                                            &Channel::on_send_done, completion, err, sizeof(err));
  if (rc != 0) {  // refused: no done will come
    completion->release();
    delete completion;
    {
      std::lock_guard<std::mutex> lock(mu_);
      sending_.erase(mine);
    }
    return failed(err[0] ? err : "the backend refused the send");
  }
  *token = mine;
  return "";
}

void Channel::on_send_done(void* arg, const char* error) {
  std::unique_ptr<SendDone> completion(static_cast<SendDone*>(arg));
  completion->release();  // the backend no longer reads the tensor
  Channel& c = *completion->channel;
  {
    std::lock_guard<std::mutex> lock(c.mu_);
    c.sending_.erase(completion->token);
    if (error != nullptr) c.send_errors_.emplace(completion->token, error);
  }
  c.send_cv_.notify_all();  // outside the lock: the woken thread does not block on it
}

std::string Channel::wait_sends(const std::vector<std::int64_t>& tokens) {
  const auto started = std::chrono::steady_clock::now();
  const auto deadline =
      started + std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout_);
  std::unique_lock<std::mutex> lock(mu_);
  auto pending = [&] {
    for (auto t : tokens) {
      if (sending_.count(t) != 0) return t;
    }
    return std::int64_t{0};
  };
  const bool sent = send_cv_.wait_until(lock, deadline, [&] { return pending() == 0; });
  waited_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now() - started).count();
  if (!sent) {
    std::ostringstream msg;
    msg << "rank " << comm_->rank << ": a native send (token " << pending()
        << ") did not complete within " << timeout_.count()
        << "s (TNT_TIMEOUT_S): its peer may be hung or dead";
    const std::string message = msg.str();
    lock.unlock();
    comm_->abort(comm_->self, message.c_str());
    return failed(message);
  }
  for (auto t : tokens) {
    auto it = send_errors_.find(t);
    if (it != send_errors_.end()) {
      const std::string message = it->second;
      lock.unlock();
      return failed(message);
    }
  }
  return "";
}

std::string Channel::recv(const std::shared_ptr<Buffer>& buffer, std::int32_t peer,
                          std::int64_t tag) {
  auto state = std::make_shared<RecvDone>();
  state->channel = shared_from_this();
  state->buffer = buffer;
  // done's argument: a reference to the state, dropped by on_recv_done
  auto* arg = new std::shared_ptr<RecvDone>(state);
  char err[1024] = {0};
  const std::int32_t rc =
      comm_->recv_async(comm_->self, buffer->data(), static_cast<std::int64_t>(buffer->bytes()),
                        peer, tag, &Channel::on_recv_done, arg, err, sizeof(err));
  if (rc != 0) {
    delete arg;
    return failed(err[0] ? err : "the backend refused the receive");
  }
  const auto started = std::chrono::steady_clock::now();
  const auto deadline =
      started + std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout_);
  std::unique_lock<std::mutex> lock(mu_);
  const bool arrived = recv_cv_.wait_until(lock, deadline, [&] { return state->done; });
  waited_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now() - started).count();
  if (!arrived) {
    lock.unlock();
    std::ostringstream msg;
    msg << "rank " << comm_->rank << ": the receive from rank " << peer << " (tag " << tag
        << ", " << buffer->bytes() << " bytes) did not complete within " << timeout_.count()
        << "s (TNT_TIMEOUT_S): rank " << peer << " may be hung or dead, or never sent it";
    const std::string message = msg.str();
    // the backend fails the receive (and keeps the buffer written until its done, which
    // the state keeps alive), and every later operation, as the Python path's timeout does
    comm_->abort(comm_->self, message.c_str());
    return failed(message);
  }
  if (!state->error.empty()) {
    const std::string message = state->error;
    lock.unlock();
    return failed(message);
  }
  return "";
}

void Channel::on_recv_done(void* arg, const char* error) {
  std::unique_ptr<std::shared_ptr<RecvDone>> holder(static_cast<std::shared_ptr<RecvDone>*>(arg));
  RecvDone& state = **holder;
  std::shared_ptr<Channel> channel = state.channel;  // alive past the state's last reference
  {
    std::lock_guard<std::mutex> lock(channel->mu_);
    state.done = true;
    if (error != nullptr) state.error = error;
  }
  channel->recv_cv_.notify_all();  // outside the lock: the woken thread does not block on it
}

}  // namespace tnt_keras
