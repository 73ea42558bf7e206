#include "communicator.h"

#include <gloo/allreduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "errors.h"
#include "gloo_compat.h"
#include "interruptible.h"
#include "p2p.h"

namespace tnt_gloo {

// ---------------------------------------------------------------- Work

bool Work::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

bool Work::wait_for(std::chrono::duration<double> timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  // wait_until on the steady clock: a very long timeout must not overflow a duration.
  const auto limit = std::chrono::duration<double>(24.0 * 3600.0 * 365.0);
  const auto deadline = std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          timeout < limit ? timeout : limit);
  return cv_.wait_until(lock, deadline, [this] { return done_; });
}

std::string Work::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void Work::complete(std::string error) {
  // steady_clock is CLOCK_MONOTONIC on Linux, the clock of Python's time.perf_counter,
  // so timelines can put this next to Python-side timestamps
  const double now = std::chrono::duration<double>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
  OnDone on_done;
  std::string message;  // a copy for on_done, which runs outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;  // the first completion wins (a p2p failure may race with it)
    on_done = std::move(on_done_);
    if (on_done) message = error;
    error_ = std::move(error);
    completed_at_ = now;
    done_ = true;
  }
  cv_.notify_all();
  if (on_done) on_done(message);
}

double Work::completion_time() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_at_;
}

// ---------------------------------------------------------------- collectives

namespace {

// Gloo's own ring or bcube (its waits end only at the timeout), or recursive doubling.
template <typename T>
void allreduce_gloo_typed(const Exec& exec, void* data, std::size_t count, ReduceOp op,
                          DType dtype, Algorithm algorithm) {
  if (algorithm == Algorithm::kDoubling) {
    return allreduce_doubling(exec, data, count, sizeof(T), reduce_function(dtype, op));
  }
  gloo::AllreduceOptions opts(exec.context);
  opts.setOutput<T>(static_cast<T*>(data), count);  // no input: reduced in place
  opts.setAlgorithm(algorithm == Algorithm::kBcube
                        ? gloo::AllreduceOptions::Algorithm::BCUBE
                        : gloo::AllreduceOptions::Algorithm::RING);
  opts.setReduceFunction(reduce_function(dtype, op));
  opts.setTag(exec.tag);
  opts.setTimeout(exec.timeout);
  gloo::allreduce(opts);
}

void allreduce_gloo(const Exec& exec, void* data, std::size_t count, DType dtype,
                    ReduceOp op, Algorithm algorithm) {
  switch (dtype) {
    case DType::kFloat16:
      return allreduce_gloo_typed<gloo::float16>(exec, data, count, op, dtype, algorithm);
    case DType::kFloat32:
      return allreduce_gloo_typed<float>(exec, data, count, op, dtype, algorithm);
    case DType::kFloat64:
      return allreduce_gloo_typed<double>(exec, data, count, op, dtype, algorithm);
    case DType::kInt32:
      return allreduce_gloo_typed<std::int32_t>(exec, data, count, op, dtype, algorithm);
    case DType::kInt64:
      return allreduce_gloo_typed<std::int64_t>(exec, data, count, op, dtype, algorithm);
  }
}

// Over TCP: interruptible.h's algorithms, so that an abort ends their waits.
void allreduce_tcp(const Exec& exec, void* data, std::size_t count, DType dtype,
                   ReduceOp op, Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kRing:
      return allreduce_ring(exec, data, count, element_size(dtype), reduce_function(dtype, op));
    case Algorithm::kDoubling:
      return allreduce_doubling(exec, data, count, element_size(dtype),
                                reduce_function(dtype, op));
    case Algorithm::kBcube:
      return allreduce_halving_doubling(exec, data, count, element_size(dtype),
                                        reduce_function(dtype, op));
  }
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

// A buffer larger than this many bytes per local rank is cut into blocks for the
// hierarchical allreduce's pipeline; at most kMaxBlocks of them.
constexpr std::size_t kBlockBytesPerRank = 1 << 20;
constexpr std::size_t kMaxBlocks = 8;
// How often the wait for the exchange between the hosts looks at this host's ranks.
constexpr auto kSharedMemoryCheck = std::chrono::milliseconds(20);

// Reduce-scatter within the host, so that local rank l holds slice l reduced over its
// host; that slice allreduced with the ranks holding slice l on the other hosts (every
// local rank on the network at once); allgather within the host. A large buffer goes
// in blocks, pipelined: a helper thread moves block k between the hosts while this
// one reduce-scatters block k+1 and allgathers block k-1, so the shared-memory steps
// hide behind the network's. One deadline for it all: the operation's timeout.
void allreduce_hierarchical(const Exec& exec, void* data, std::size_t count, DType dtype,
                            ReduceOp op, Algorithm algorithm) {
  Hierarchy& h = *exec.hierarchy;
  const auto deadline = std::chrono::steady_clock::now() + exec.timeout;
  const std::size_t es = element_size(dtype);
  const int local_size = h.layout.local_size;
  const std::size_t blocks = std::max<std::size_t>(1, std::min(
      kMaxBlocks, count * es / (kBlockBytesPerRank * static_cast<std::size_t>(local_size))));
  auto block = [&](std::size_t k) {
    return ShmAllreduce::slice(count, static_cast<int>(blocks), static_cast<int>(k));
  };
  char* const bytes = static_cast<char*>(data);
  const int hosts = h.layout.hosts;
  if (algorithm == Algorithm::kDoubling && (hosts & (hosts - 1)) != 0) {
    algorithm = Algorithm::kRing;
  }
  // Ends the helper's waits between the hosts when this thread gives up. (Without the
  // helper, this thread's own exchange is ended by the communicator's, at poisoning.)
  Interrupt interrupt;
  // Between the hosts: this rank's slice of block k, its waits ended by `stop`.
  auto exchange = [&](std::size_t k, Interrupt* stop) {
    const auto range = block(k);
    const auto mine = ShmAllreduce::slice(range.second - range.first, local_size,
                                          h.layout.local_rank);
    if (mine.second == mine.first) return;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      throw GlooError("did not complete within " +
                      std::to_string(std::chrono::duration<double>(exec.timeout).count()) +
                      "s (TNT_TIMEOUT_S)");
    }
    const Exec cross{h.cross, left, h.next_tag++, exec.scratch, nullptr, nullptr, stop};
    void* const slice = bytes + (range.first + mine.first) * es;
    const std::size_t n = mine.second - mine.first;
    allreduce_tcp(cross, slice, n, dtype, op, algorithm);
  };
  auto within = [&](bool reduce, std::size_t k) {
    const auto range = block(k);
    if (reduce) {
      h.local->reduce_scatter(bytes + range.first * es, range.second - range.first, dtype, op,
                              exec.timeout, deadline);
    } else {
      h.local->allgather(bytes + range.first * es, range.second - range.first, dtype,
                         exec.timeout, deadline);
    }
  };
  auto between_failed = [&h](std::exception_ptr error) {
    return GlooError("the allreduce between the hosts (ranks " +
                     join_ranks(h.layout.cross_ranks) + ") failed: " +
                     describe_exception(error));
  };
  if (blocks == 1) {
    within(true, 0);
    try {
      exchange(0, exec.interrupt);
    } catch (...) {
      throw between_failed(std::current_exception());
    }
    within(false, 0);
    return;
  }
  // The helper takes block k once it is reduce-scattered (`ready` > k) and reports
  // `done`; on failure it stores the error and stops.
  std::mutex mu;
  std::condition_variable cv;
  std::size_t ready = 0, done = 0;
  bool stop = false;
  std::exception_ptr error;
  std::thread helper([&] {
    for (std::size_t k = 0; k < blocks; ++k) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return ready > k || stop; });
        if (stop) return;
      }
      try {
        exchange(k, &interrupt);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        error = std::current_exception();
        stop = true;
        cv.notify_all();
        return;
      }
      std::lock_guard<std::mutex> lock(mu);
      done = k + 1;
      cv.notify_all();
    }
  });
  // Waits for block k's exchange; throws the helper's error, or the failure of a rank on
  // this host (its abort flag, its exit), looked for every kSharedMemoryCheck: a local
  // failure must not wait for the exchange's timeout.
  auto exchanged = [&](std::size_t k) {
    std::unique_lock<std::mutex> lock(mu);
    while (!cv.wait_for(lock, kSharedMemoryCheck, [&] { return done > k || error; })) {
      const std::string local = h.local->failure();
      if (!local.empty()) throw GlooError(local);
    }
    if (error) throw between_failed(error);
  };
  try {
    for (std::size_t k = 0; k < blocks; ++k) {
      within(true, k);
      {
        std::lock_guard<std::mutex> lock(mu);
        ready = k + 1;
      }
      cv.notify_all();
      if (k > 0) {
        exchanged(k - 1);
        within(false, k - 1);
      }
    }
    exchanged(blocks - 1);
    within(false, blocks - 1);
  } catch (...) {
    // The helper may be waiting for a peer. Closing our connections fails the peers'
    // waits on us (the communicator is being poisoned anyway), not the helper's own:
    // the interrupt ends those.
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    try {
      h.cross->closeConnections();
    } catch (...) {
      // already broken
    }
    // After the close: Gloo can no longer write into the helper's buffers.
    interrupt.fire("the allreduce within the host failed");
    helper.join();
    throw;
  }
  helper.join();
}

}  // namespace

void run_allreduce(const Exec& exec, void* data, std::size_t count, DType dtype,
                   ReduceOp op, Algorithm algorithm) {
  if (count == 0 || exec.context->size == 1) return;
  if (exec.shm != nullptr) return exec.shm->allreduce(data, count, dtype, op, exec.timeout);
  if (exec.hierarchy != nullptr) {
    return allreduce_hierarchical(exec, data, count, dtype, op, algorithm);
  }
  allreduce_tcp(exec, data, count, dtype, op, algorithm);
}

void run_allreduce_gather(const Exec& exec, const std::vector<Piece>& pieces, double factor,
                          void* out, std::size_t count, DType dtype, ReduceOp op,
                          Algorithm algorithm) {
  if (count == 0) return;
  if (exec.shm != nullptr && exec.context->size > 1) {
    return exec.shm->allreduce_gather(pieces, factor, out, count, dtype, op, exec.timeout);
  }
  fill_gathered(static_cast<char*>(out), 0, count, pieces, factor, dtype,
                [](void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); },
                [dtype](void* dst, const void* src, std::size_t n, double f) {
                  scale_copy(dtype, dst, src, n, f);
                });
  run_allreduce(exec, out, count, dtype, op, algorithm);
}

void run_broadcast(const Exec& exec, void* data, std::size_t nbytes, int root) {
  if (nbytes == 0 || exec.context->size == 1) return;
  broadcast_tree(exec, data, nbytes, root);
}

void run_allgather(const Exec& exec, const void* in, void* out, std::size_t nbytes) {
  if (nbytes == 0) return;
  if (exec.context->size == 1) {
    std::memmove(out, in, nbytes);
    return;
  }
  allgather_ring(exec, in, out, nbytes);
}

void run_barrier(const Exec& exec) {
  if (exec.context->size == 1) return;
  barrier_dissemination(exec);
}

// ---------------------------------------------------------------- Communicator

// State the worker thread shares; outlives the Communicator if the worker is abandoned,
// or while a native hand-off holds it (shared_state()).
struct Communicator::Shared {
  std::shared_ptr<gloo::Context> context;
  std::chrono::milliseconds timeout{0};
  // Set before the worker starts, released by close() after it exited; poison() reads
  // them under `mu`. At most one is set.
  std::shared_ptr<ShmAllreduce> shm;
  std::shared_ptr<Hierarchy> hierarchy;
  // Sends and receives, beside the worker (see p2p.h); set before the worker starts.
  std::shared_ptr<PointToPoint> p2p;
  // Ends the waits of the collectives over TCP (interruptible.h) when the communicator is
  // poisoned: closing the connections does not end this rank's own waits in Gloo.
  Interrupt interrupt;

  std::mutex mu;  // guards the fields below
  std::condition_variable cv;  // queue filled, stopping, worker idle, worker exited
  std::deque<Task> queue;
  bool stopping = false;
  bool busy = false;
  std::uint64_t finished = 0;  // operations run to their end (for connection_failed)
  bool exited = false;
  bool connections_closed = false;
  std::string failure;

  // Held by whichever thread runs a Gloo call on the context (the worker, a waiting
  // thread running its operation inline, or the benchmark baseline); guards next_tag
  // and scratch too.
  std::mutex context_mu;
  std::uint32_t next_tag = 0;
  std::vector<char> scratch;
};

Communicator::Communicator(const ConnectOptions& options,
                           const std::shared_ptr<gloo::rendezvous::Store>& store)
    : rank_(options.rank), size_(options.size), shared_(std::make_shared<Shared>()),
      host_layout_(1, options.size) {
  shared_->timeout = options.timeout;
  std::shared_ptr<gloo::transport::Device> device;
  try {
    gloo::transport::tcp::attr attr;
    if (!options.iface.empty()) {
      attr.iface = options.iface;
    } else {
      attr.hostname = options.hostname;
    }
    device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
    context->setTimeout(options.timeout);
    connect_full_mesh(*context, store, device);
    shared_->context = std::move(context);
  } catch (...) {
    throw GlooError("building the full TCP mesh failed: " +
                    describe_exception(std::current_exception()));
  }
  ShmSetup setup;
  try {
    ShmOptions shm = options.shm;
    shm.rank = rank_;
    shm.size = size_;
    shm.timeout = options.timeout;
    setup = setup_shm(shm, *store);
    shm_reason_ = std::move(setup.reason);
    if (setup.shm) shm_name_ = setup.shm->segment_name();
    shm_view_ = setup.shm;
  } catch (...) {
    throw GlooError("setting up the shared-memory allreduce failed: " +
                    describe_exception(std::current_exception()));
  }
  if (setup.hierarchical) {
    // The ranks with this local index on every host, on the same device and store under
    // a prefix of their own (all of them connect theirs at once).
    const HostLayout& layout = setup.layout;
    try {
      auto cross = std::make_shared<gloo::rendezvous::Context>(layout.host_index, layout.hosts);
      cross->setTimeout(options.timeout);
      connect_full_mesh(*cross,
                        make_prefix_store("hier" + std::to_string(layout.local_rank), store),
                        device);
      shared_->hierarchy = std::make_shared<Hierarchy>(
          Hierarchy{std::move(setup.shm), std::move(cross), layout});
    } catch (...) {
      throw GlooError("connecting the ranks " + join_ranks(layout.cross_ranks) +
                      " (local rank " + std::to_string(layout.local_rank) +
                      " of every host) failed: " +
                      describe_exception(std::current_exception()));
    }
    hierarchical_ = true;
    host_layout_ = {layout.hosts, layout.local_size};
  } else {
    shared_->shm = std::move(setup.shm);
  }
  std::weak_ptr<Shared> weak = shared_;
  auto on_failure = [weak](const std::string& what) {
    if (auto shared = weak.lock()) connection_failed(*shared, what);
  };
  watches_.push_back(std::make_unique<ConnectionWatch>(shared_->context, on_failure));
  if (shared_->hierarchy) {
    watches_.push_back(std::make_unique<ConnectionWatch>(shared_->hierarchy->cross, on_failure));
  }
  // A failed send or receive fails the communicator, as a failed collective does.
  // Ranks of this host exchange their messages through rings in the shared-memory group
  // (the flat one, or the hierarchy's local one); the others over Gloo.
  shared_->p2p = std::make_shared<PointToPoint>(
      shared_->context,
      [weak](const std::string& reason) {
        if (auto shared = weak.lock()) poison(*shared, reason);
      },
      shared_->hierarchy ? shared_->hierarchy->local : shared_->shm);
  worker_ = std::thread(&Communicator::run, shared_);
}

Communicator::~Communicator() { close(std::chrono::milliseconds(5000)); }

std::shared_ptr<Work> Communicator::submit(std::string name, Body body, bool inline_ok,
                                           Work::OnDone on_done) {
  return submit_to(*shared_, std::move(name), std::move(body), inline_ok, std::move(on_done));
}

std::shared_ptr<Work> Communicator::submit_to(Shared& shared, std::string name, Body body,
                                              bool inline_ok, Work::OnDone on_done) {
  auto work = std::make_shared<Work>(std::move(name), std::move(on_done));
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    if (shared.stopping) {
      throw GlooError("the communicator is closed");
    }
    if (!shared.failure.empty()) {
      throw GlooError("an earlier collective failed: " + shared.failure);
    }
    shared.queue.push_back(Task{work, std::move(body), inline_ok});
  }
  shared.cv.notify_all();
  return work;
}

void Communicator::poison(Shared& shared, const std::string& reason) {
  std::shared_ptr<ShmAllreduce> shm;
  std::shared_ptr<Hierarchy> hierarchy;
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    if (shared.failure.empty()) shared.failure = reason;
    shm = shared.shm;
    hierarchy = shared.hierarchy;
  }
  if (hierarchy) shm = hierarchy->local;
  // Peers waiting in a shared-memory allreduce see the flag and fail now (and so does
  // our own worker if it waits there).
  if (shm) shm->abort(ShmAllreduce::kFailed);
  // Pending sends and receives fail, later ones are refused.
  if (shared.p2p) shared.p2p->fail(reason);
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    if (shared.connections_closed || !shared.context) return;
    shared.connections_closed = true;
  }
  // Closing our ends makes every peer blocked on this rank fail now, not at its timeout.
  try {
    shared.context->closeConnections();
  } catch (...) {
    // The connections may already be broken; there is nothing left to release.
  }
  if (hierarchy) {
    try {
      hierarchy->cross->closeConnections();
    } catch (...) {
      // as above
    }
  }
  // After the close, so that Gloo can no longer write into the buffers whose waits end.
  shared.interrupt.fire(reason);
}

// How long an operation in flight may go on after a connection of this rank failed: it may
// still finish from what arrived (a peer that finished the operation and exited), or fail
// by itself; past this it waits on a send Gloo will never end (connection_watch.h).
constexpr auto kConnectionGrace = std::chrono::milliseconds(1500);

void Communicator::connection_failed(Shared& s, const std::string& what) {
  std::unique_lock<std::mutex> lock(s.mu);
  if (!s.busy || s.stopping || !s.failure.empty()) return;  // the next operation fails by itself
  const std::uint64_t running = s.finished;
  const bool over = s.cv.wait_for(lock, kConnectionGrace, [&s, running] {
    return s.finished != running || s.stopping || !s.failure.empty();
  });
  if (over) return;
  lock.unlock();
  poison(s, "a connection to a peer failed (" + what + ") and the operation in flight did not "
            "end within " + std::to_string(kConnectionGrace.count()) + " ms after");
}

void Communicator::execute(Shared& s, Task& task, const std::string& failure) {
  std::string error;
  if (!failure.empty()) {
    error = "an earlier collective failed: " + failure;
  } else {
    std::lock_guard<std::mutex> guard(s.context_mu);
    try {
      task.body(Exec{s.context, s.timeout, s.next_tag++, s.scratch, s.shm.get(),
                     s.hierarchy.get(), &s.interrupt});
    } catch (...) {
      error = describe_exception(std::current_exception());
    }
  }
  if (!error.empty() && failure.empty()) {
    std::string cause;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      cause = s.failure;  // set meanwhile by another thread (abort, a failed connection)
    }
    if (!cause.empty() && error.find(cause) == std::string::npos) {
      error += " (" + cause + ")";
    }
    poison(s, task.work->name() + ": " + error);
  }
  task.body = nullptr;  // drop captured state before the work is reported done
  task.work->complete(std::move(error));
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.busy = false;
    ++s.finished;
  }
  s.cv.notify_all();
}

void Communicator::run(std::shared_ptr<Shared> shared) {
  Shared& s = *shared;
  for (;;) {
    Task task;
    std::string failure;
    {
      std::unique_lock<std::mutex> lock(s.mu);
      // `busy` also covers a task a waiting thread runs itself (see wait): one at a
      // time, in queue order.
      s.cv.wait(lock, [&s] { return (!s.queue.empty() || s.stopping) && !s.busy; });
      if (s.queue.empty()) break;  // stopping, and everything queued has run
      task = std::move(s.queue.front());
      s.queue.pop_front();
      s.busy = true;
      failure = s.failure;
    }
    execute(s, task, failure);
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.exited = true;
  }
  s.cv.notify_all();
}

bool Communicator::wait(const std::shared_ptr<Work>& work,
                        std::chrono::duration<double> timeout) {
  // If the work is next in line and the worker has not picked it up yet (it sleeps, or
  // is not scheduled yet on a busy machine), the waiting thread runs it itself: same
  // order, same code, two thread hand-offs fewer. Only when the caller waits at least
  // as long as the operation's own timeout, since a running operation cannot stop early.
  if (timeout >= shared_->timeout) {
    Task task;
    std::string failure;
    bool claimed = false;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      const bool next = !shared_->queue.empty() && shared_->queue.front().work == work;
      if (next && !shared_->busy && shared_->queue.front().inline_ok) {
        task = std::move(shared_->queue.front());
        shared_->queue.pop_front();
        shared_->busy = true;
        failure = shared_->failure;
        claimed = true;
      }
    }
    if (claimed) execute(*shared_, task, failure);
  }
  return work->wait_for(timeout);
}

std::vector<double> Communicator::time_direct_allreduce(void* data, std::size_t count,
                                                         DType dtype, Algorithm algorithm,
                                                         int iters, bool shm) {
  {
    std::unique_lock<std::mutex> lock(shared_->mu);
    shared_->cv.wait(lock, [this] { return shared_->queue.empty() && !shared_->busy; });
    if (!shared_->failure.empty()) {
      throw GlooError("an earlier collective failed: " + shared_->failure);
    }
    if (shm && !shared_->shm && !shared_->hierarchy) {
      throw std::invalid_argument("this communicator's allreduce does not use shared memory");
    }
  }
  std::lock_guard<std::mutex> guard(shared_->context_mu);
  std::vector<double> seconds;
  seconds.reserve(static_cast<std::size_t>(iters > 0 ? iters : 0));
  try {
    for (int i = 0; i < iters; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      const Exec exec{shared_->context, shared_->timeout, shared_->next_tag++,
                      shared_->scratch, shm ? shared_->shm.get() : nullptr,
                      shm ? shared_->hierarchy.get() : nullptr, &shared_->interrupt};
      if (shm) {
        run_allreduce(exec, data, count, dtype, ReduceOp::kSum, algorithm);
      } else {
        allreduce_gloo(exec, data, count, dtype, ReduceOp::kSum, algorithm);
      }
      seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  } catch (...) {
    const std::string error = describe_exception(std::current_exception());
    poison(*shared_, "baseline allreduce: " + error);
    throw GlooError(error);
  }
  return seconds;
}

std::shared_ptr<Work> Communicator::send(const void* data, std::size_t nbytes, int dest,
                                         std::uint64_t tag, std::string name) {
  return shared_->p2p->send(data, nbytes, dest, tag, std::move(name));
}

std::shared_ptr<Work> Communicator::recv(void* data, std::size_t nbytes, int src,
                                         std::uint64_t tag, std::string name) {
  return shared_->p2p->recv(data, nbytes, src, tag, std::move(name));
}

std::shared_ptr<Work> Communicator::send_to(Shared& shared, const void* data,
                                            std::size_t nbytes, int dest, std::uint64_t tag,
                                            std::string name, Work::OnDone on_done) {
  return shared.p2p->send(data, nbytes, dest, tag, std::move(name), std::move(on_done));
}

std::shared_ptr<Work> Communicator::recv_to(Shared& shared, void* data, std::size_t nbytes,
                                            int src, std::uint64_t tag, std::string name,
                                            Work::OnDone on_done) {
  return shared.p2p->recv(data, nbytes, src, tag, std::move(name), std::move(on_done));
}

void Communicator::abort(const std::string& reason) { poison(*shared_, reason); }

std::string Communicator::p2p_transport(int peer) const {
  if (peer < 0 || peer >= size_) throw std::invalid_argument("p2p_transport: no such rank");
  return shared_->p2p->transport(peer);
}

void Communicator::abort_to(Shared& shared, const std::string& reason) { poison(shared, reason); }

std::string Communicator::failure() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->failure;
}

bool Communicator::close(std::chrono::milliseconds grace) {
  if (closed_) return true;
  closed_ = true;
  // Sends and receives not waited for fail; their threads stop (they never block on
  // the worker, nor it on them).
  if (shared_->p2p) shared_->p2p->shutdown("the communicator is closed");
  if (!worker_.joinable()) {
    watches_.clear();
    return true;
  }
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->stopping = true;
  }
  shared_->cv.notify_all();
  auto exited = [this](std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(shared_->mu);
    return shared_->cv.wait_for(lock, limit, [this] { return shared_->exited; });
  };
  bool clean = exited(grace);
  if (!clean) {
    // Operations are still running past the grace period: fail them (and the rest).
    poison(*shared_, "the communicator was closed while collectives were in flight");
    clean = exited(std::chrono::milliseconds(5000));
  }
  watches_.clear();  // before the contexts go (with the worker or after it)
  if (!clean) {
    // A transport call ignored the abort. Leave the thread the shared state (it keeps
    // the context alive) rather than hang the process.
    worker_.detach();
    return false;
  }
  worker_.join();
  std::shared_ptr<gloo::Context> context;
  std::shared_ptr<ShmAllreduce> shm;
  std::shared_ptr<Hierarchy> hierarchy;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    context = std::move(shared_->context);
    shm = std::move(shared_->shm);
    hierarchy = std::move(shared_->hierarchy);
  }
  if (hierarchy) shm = hierarchy->local;
  // A peer still waiting for us in an allreduce we will never join fails at once.
  // (Peers still reading our last chunk keep their mapping of it: unaffected.)
  if (shm) shm->abort(ShmAllreduce::kClosed);
  shm.reset();  // unmaps the segments
  hierarchy.reset();  // the same for the hierarchy's context
  context.reset();  // closes the sockets and stops using the device
  return true;
}

}  // namespace tnt_gloo
