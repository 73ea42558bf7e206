// Notice a TCP connection of a Gloo context failing, for waits that Gloo leaves blind.
//
// When a pair's connection fails (the peer exited, reset or closed it), Gloo signals the
// receives posted on that pair and the sends still waiting for the peer's go-ahead, but not
// a send already partly written into the socket: its wait goes on until the operation's
// timeout (tcp::Pair::signalException walks the queue of written operations for bound
// buffers only). A peer that received everything it needed and died before reading all of
// ours leaves exactly that behind: the hierarchical allreduce's helper thread waited there
// for TNT_TIMEOUT_S while its host's ranks waited for it. A ConnectionWatch keeps one
// receive of one byte posted on every pair of the context (a slot nothing ever sends on),
// so a failing pair signals it, and a thread waiting for it reports the failure.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

namespace tnt_gloo {

class ConnectionWatch {
 public:
  // Watches every pair of `context` (connected); `on_failure(what Gloo said)` runs on the
  // watch's thread, once, when one of them fails.
  ConnectionWatch(const std::shared_ptr<gloo::Context>& context,
                  std::function<void(const std::string&)> on_failure);
  // Stops the thread (a failure reported later is not). Call before the context's
  // connections close for good, and before the context goes.
  ~ConnectionWatch();
  ConnectionWatch(const ConnectionWatch&) = delete;
  ConnectionWatch& operator=(const ConnectionWatch&) = delete;

 private:
  char byte_ = 0;
  std::unique_ptr<gloo::transport::UnboundBuffer> sentinel_;
  std::thread thread_;
};

}  // namespace tnt_gloo
