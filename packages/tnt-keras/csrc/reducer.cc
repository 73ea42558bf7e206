#include "reducer.h"

#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>
#include <sstream>

namespace tnt_keras {

namespace {

constexpr std::size_t kAlign = 64;

std::size_t itemsize(std::int32_t dtype) {
  switch (dtype) {
    case TNT_NATIVE_FLOAT16: return 2;
    case TNT_NATIVE_FLOAT32: return 4;
    case TNT_NATIVE_FLOAT64: return 8;
    case TNT_NATIVE_INT32: return 4;
    case TNT_NATIVE_INT64: return 8;
    default: return 0;
  }
}

// dst = src * factor, as numpy's multiply(src, dtype.type(factor)) computes it (the
// Python path's), so both paths push the same bits.
template <typename T>
void scale_into(T* dst, const T* src, std::int64_t n, T factor) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = src[i] * factor;
}

void copy_scaled(std::int32_t dtype, void* dst, const void* src, std::int64_t n, double factor) {
  const std::size_t bytes = static_cast<std::size_t>(n) * itemsize(dtype);
  if (factor == 0.0) {  // a rank without samples pushes zeros, never 0 * (a stand-in's NaN)
    std::memset(dst, 0, bytes);
  } else if (factor == 1.0) {
    std::memcpy(dst, src, bytes);
  } else {
    switch (dtype) {
      case TNT_NATIVE_FLOAT16:
        scale_into(static_cast<_Float16*>(dst), static_cast<const _Float16*>(src), n,
                   static_cast<_Float16>(factor));
        break;
      case TNT_NATIVE_FLOAT32:
        scale_into(static_cast<float*>(dst), static_cast<const float*>(src), n,
                   static_cast<float>(factor));
        break;
      case TNT_NATIVE_FLOAT64:
        scale_into(static_cast<double*>(dst), static_cast<const double*>(src), n, factor);
        break;
      case TNT_NATIVE_INT32:  // Python refuses a non-integral factor for integer tensors
        scale_into(static_cast<std::int32_t*>(dst), static_cast<const std::int32_t*>(src), n,
                   static_cast<std::int32_t>(factor));
        break;
      case TNT_NATIVE_INT64:
        scale_into(static_cast<std::int64_t*>(dst), static_cast<const std::int64_t*>(src), n,
                   static_cast<std::int64_t>(factor));
        break;
    }
  }
}

}  // namespace

double monotonic_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

Buffer::Buffer(std::size_t bytes, bool zeroed) : data_(nullptr), bytes_(bytes) {
  const std::size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  data_ = static_cast<char*>(std::aligned_alloc(kAlign, rounded ? rounded : kAlign));
  if (data_ == nullptr) throw std::bad_alloc();
  // padding between tensors is reduced too
  if (zeroed) std::memset(data_, 0, rounded ? rounded : kAlign);
}

Buffer::~Buffer() { std::free(data_); }

LedgerWait::LedgerWait(tnt_stall_ledger* ledger, std::int64_t seq) : ledger_(nullptr) {
  if (ledger == nullptr || seq <= 0 || __atomic_load_n(&ledger->waiting_for, __ATOMIC_ACQUIRE) != 0) {
    return;
  }
  // the start and the operation first, the number last: a reader that sees the number
  // sees its start
  double now = monotonic_seconds();
  __atomic_store(&ledger->waiting_since, &now, __ATOMIC_RELAXED);
  __atomic_store_n(&ledger->waiting_op, static_cast<std::int32_t>(TNT_STALL_ALLREDUCE),
                   __ATOMIC_RELAXED);
  std::int64_t none = 0;
  if (__atomic_compare_exchange_n(&ledger->waiting_for, &none, seq, false, __ATOMIC_RELEASE,
                                  __ATOMIC_RELAXED)) {
    ledger_ = ledger;
  }
}

LedgerWait::~LedgerWait() {
  if (ledger_ != nullptr) __atomic_store_n(&ledger_->waiting_for, std::int64_t{0}, __ATOMIC_RELEASE);
}

Reducer::Reducer(const tnt_native_comm* comm, tnt_stall_ledger* ledger,
                 std::vector<BucketSpec> buckets, std::int32_t op, bool overlap, double timeout_s,
                 PythonHooks hooks)
    : comm_(comm),
      ledger_(ledger),
      buckets_(std::move(buckets)),
      op_(op),
      gather_(tnt_native_comm_has_gather(comm) != 0),
      overlap_(overlap),
      timeout_(timeout_s > 0 ? timeout_s : 1e9),
      hooks_(hooks),
      pushed_(buckets_.size(), 0),
      complete_(buckets_.size(), 0),
      done_(buckets_.size(), 0),
      pushed_at_(buckets_.size(), 0.0),
      issued_at_(buckets_.size(), 0.0),
      done_at_(buckets_.size(), 0.0),
      seq_(buckets_.size(), 0) {
  pieces_.resize(buckets_.size());
  for (const auto& b : buckets_) {
    buffers_.push_back(std::make_shared<Buffer>(static_cast<std::size_t>(b.size) * itemsize(b.dtype)));
  }
}

std::string Reducer::push(std::size_t b, const std::vector<const void*>& srcs,
                          const std::vector<std::int64_t>& counts,
                          const std::vector<std::int64_t>& offsets, double factor,
                          std::shared_ptr<void> keep) {
  if (b >= buckets_.size()) return "bucket index out of range";
  const BucketSpec& spec = buckets_[b];
  std::shared_ptr<Buffer> buffer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!poisoned_.empty()) return poisoned_;
    if (pushed_[b]) {
      return "bucket " + std::to_string(b) +
             " was pushed twice in one step (a step that failed half-way leaves the "
             "reducer unusable: start the training again)";
    }
    pushed_[b] = 1;
    pushed_at_[b] = monotonic_seconds();
    // A tensor of an earlier step still wraps this buffer: write into a fresh one.
    if (buffers_[b].use_count() > 1) {
      buffers_[b] = std::make_shared<Buffer>(buffers_[b]->bytes());
    }
    buffer = buffers_[b];
  }
  const std::size_t isz = itemsize(spec.dtype);
  for (std::size_t i = 0; i < srcs.size(); ++i) {
    if (offsets[i] < 0 || counts[i] < 0 || offsets[i] + counts[i] > spec.size) {
      std::ostringstream msg;
      msg << "tensor of " << counts[i] << " elements at offset " << offsets[i]
          << " does not fit bucket " << b << " of " << spec.size << " elements";
      std::lock_guard<std::mutex> lock(mu_);
      poisoned_ = msg.str();
      return poisoned_;
    }
    if (!gather_) {
      copy_scaled(spec.dtype, buffer->data() + static_cast<std::size_t>(offsets[i]) * isz,
                  srcs[i], counts[i], factor);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (gather_) pieces_[b] = Pieces{srcs, counts, offsets, factor, std::move(keep)};
    complete_[b] = 1;
  }
  if (overlap_) issue_ready();
  std::unique_lock<std::mutex> lock(mu_);
  if (!refused_.empty()) {
    std::string message = refused_;
    lock.unlock();
    return failed(message);
  }
  return poisoned_;
}

std::string Reducer::agree_once() {
  std::lock_guard<std::mutex> lock(agree_mu_);
  if (!agreed_) {
    agreed_ = true;
    if (hooks_.agree != nullptr) {
      char err[2048] = {0};
      if (hooks_.agree(hooks_.arg, err, sizeof(err)) != 0) {
        agree_error_ = err[0] ? err : "the ranks did not agree on the gradient buckets";
      }
    }
  }
  return agree_error_;
}

void Reducer::issue_ready() {
  const std::string disagreement = agree_once();
  std::lock_guard<std::mutex> issuing(issue_mu_);
  for (;;) {
    std::size_t b;
    std::shared_ptr<Buffer> buffer;
    Pieces pieces;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!disagreement.empty() && poisoned_.empty()) poisoned_ = disagreement;
      if (!poisoned_.empty() || next_to_issue_ >= buckets_.size() || !complete_[next_to_issue_]) {
        cv_.notify_all();
        return;
      }
      b = next_to_issue_++;
      issued_at_[b] = monotonic_seconds();
      if (buckets_[b].size == 0) {
        done_[b] = 1;
        done_at_[b] = issued_at_[b];
        pieces_[b] = Pieces{};
        continue;
      }
      ++in_flight_;
      buffer = buffers_[b];
      pieces = std::move(pieces_[b]);
      pieces_[b] = Pieces{};
      // its number among the job's collectives: the ledger's next (tnt_stall_ledger.h)
      seq_[b] = ledger_ == nullptr ? 0 : __atomic_add_fetch(&ledger_->entered, 1, __ATOMIC_RELAXED);
    }
    auto* completion = new Completion{shared_from_this(), b, pieces.keep};
    char err[1024] = {0};
    const std::int32_t rc =
        gather_ ? comm_->allreduce_gather_async(
                      comm_->self, pieces.srcs.data(), pieces.counts.data(),
                      pieces.offsets.data(), static_cast<std::int32_t>(pieces.srcs.size()),
                      pieces.factor, buffer->data(), buckets_[b].size, buckets_[b].dtype, op_,
                      &Reducer::on_done, completion, err, sizeof(err))
                : comm_->allreduce_async(comm_->self, buffer->data(), buckets_[b].size,
                                         buckets_[b].dtype, op_, &Reducer::on_done, completion,
                                         err, sizeof(err));
    if (rc != 0) {  // a closed or failed communicator: a communication failure
      delete completion;
      std::lock_guard<std::mutex> lock(mu_);
      --in_flight_;
      if (refused_.empty()) refused_ = err[0] ? err : "the backend refused the allreduce";
      if (poisoned_.empty()) poisoned_ = refused_;
      cv_.notify_all();
      return;
    }
  }
}

void Reducer::on_done(void* arg, const char* error) {
  std::unique_ptr<Completion> completion(static_cast<Completion*>(arg));
  Reducer& r = *completion->reducer;
  std::lock_guard<std::mutex> lock(r.mu_);
  r.done_[completion->bucket] = 1;
  r.done_at_[completion->bucket] = monotonic_seconds();
  --r.in_flight_;
  if (error != nullptr && r.error_.empty()) r.error_ = error;
  r.cv_.notify_all();
}

// A communication failure (the backend's error, a refusal, a timeout): Python records it
// as the process's CommError (which names the failing rank at exit) and words it; every
// later call fails with that wording.
std::string Reducer::failed(const std::string& message) {
  std::string final_message = message;
  if (hooks_.failed != nullptr) {
    char out[4096] = {0};
    hooks_.failed(hooks_.arg, message.c_str(), out, sizeof(out));
    if (out[0]) final_message = out;
  }
  std::lock_guard<std::mutex> lock(mu_);
  poisoned_ = final_message;
  refused_.clear();
  return final_message;
}

std::string Reducer::finish(std::vector<std::shared_ptr<Buffer>>* out) {
  if (!overlap_) issue_ready();
  std::unique_lock<std::mutex> lock(mu_);
  if (!refused_.empty()) {
    std::string message = refused_;
    lock.unlock();
    return failed(message);
  }
  if (!poisoned_.empty()) return poisoned_;  // reported when it happened (or not a comm error)
  if (next_to_issue_ != buckets_.size()) {
    std::ostringstream msg;
    msg << "the gradient reduction finished before every bucket was pushed (bucket "
        << next_to_issue_ << " of " << buckets_.size() << " missing)";
    poisoned_ = msg.str();
    return poisoned_;
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout_);
  auto first_not_done = [this] {
    std::size_t first = 0;
    while (first < done_.size() && done_[first]) ++first;
    return first;
  };
  auto all_done = [&] { return first_not_done() == done_.size(); };
  // Marked in the stall ledger only when it blocks, as the Python path's waits are; kept
  // until this function returns, so that a failure reported below names this wait.
  const std::size_t waited = first_not_done();
  LedgerWait marked(ledger_, waited < seq_.size() ? seq_[waited] : 0);
  if (!cv_.wait_until(lock, deadline, all_done)) {
    const std::size_t first = first_not_done();
    std::ostringstream msg;
    msg << "rank " << comm_->rank << ": the allreduce of gradient bucket " << first << " ("
        << static_cast<std::size_t>(buckets_[first].size) * itemsize(buckets_[first].dtype)
        << " bytes) did not complete within " << timeout_.count()
        << "s (TNT_TIMEOUT_S): a peer rank is stuck or gone";
    lock.unlock();
    return failed(msg.str());
  }
  if (!error_.empty()) {
    std::string message = error_;
    lock.unlock();
    return failed(message);
  }
  out->assign(buffers_.begin(), buffers_.end());
  last_times_.clear();
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    last_times_.push_back(pushed_at_[b]);
    last_times_.push_back(issued_at_[b]);
    last_times_.push_back(done_at_[b]);
  }
  std::fill(pushed_.begin(), pushed_.end(), 0);
  std::fill(complete_.begin(), complete_.end(), 0);
  std::fill(done_.begin(), done_.end(), 0);
  next_to_issue_ = 0;
  return "";
}

std::vector<double> Reducer::last_times() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_times_;
}

}  // namespace tnt_keras
