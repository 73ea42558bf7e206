#include "shm_allreduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <new>
#include <random>
#include <sstream>
#include <stdexcept>

#include "errors.h"
#include "shm_futex.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace tnt_gloo {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kMagic = 0x316d68732d746e74ULL;  // "tnt-shm1", little endian
constexpr std::size_t kLine = 64;
constexpr std::size_t kHeaderBytes = 4096;  // control block; the slots start page-aligned
// A sleeping waiter wakes at least this often to check the deadline, peer exits and
// abort flags: the bound on how late it notices a dead peer.
constexpr auto kSlice = std::chrono::milliseconds(20);
// Chunks up to this size are reduced whole by every rank (one synchronisation); larger
// ones are reduce-scattered (each rank reduces 1/p, then all gather), which reads p times
// fewer bytes per rank at the cost of a second synchronisation. On 2 ranks the whole
// reduction reads no more than reduce-scatter and writes less, so 2 ranks always use it.
constexpr std::size_t kWholeMaxBytes = 32 << 10;
// A sum of two ranks' float32 or float64 data (gradients) of this size on is written past
// the caches (stream_sum): larger than a core's second-level cache (1-2 MiB on the
// machines measured), its result is no longer there when read, and plain stores would
// first fetch each line of the output from memory only to overwrite it.
constexpr std::size_t kStreamOutMinBytes = 1 << 20;
// Spin before sleeping: waking a sleeper costs tens of µs on a VM (its vCPU halts).
// Measured on the 2-vCPU development VM, two processes passing a flag back and forth:
// 0.4 µs round trip spinning, 30-46 µs sleeping on a futex; on one shared CPU, 108 µs
// spinning 50 µs without yielding, 3.7 µs yielding between bursts (see wait_for_peer).
constexpr int kDefaultSpinUs = 50;

// Copies into a slot from this size on bypass the caches (see stream_copy).
constexpr std::size_t kStreamMinBytes = 4096;
// ShmCopy::kAuto: copies from this size on are timed (smaller ones tell little), the
// first kTimingWarmup of them not kept, then kTimingSamples of each way compared.
constexpr std::size_t kTimingMinBytes = 64 << 10;
constexpr std::uint32_t kTimingWarmup = 4;
constexpr std::size_t kTimingSamples = 16;

// The control block at the start of every segment. Written once by its owner before
// its name is published, except the atomics. seq and waiters share a line (the
// publisher writes one and reads the other); the abort flag has its own.
struct Control {
  std::uint64_t magic;
  std::uint32_t rank;
  std::uint32_t size;
  std::uint64_t chunk_bytes;
  std::int64_t pid;
  std::uint64_t start_time;
  // Phases this rank has completed: 3 per chunk (data in, part reduced, consumed),
  // growing across operations and compared modulo 2^32. The futex word.
  alignas(kLine) std::atomic<std::uint32_t> seq;
  std::atomic<std::uint32_t> waiters;  // ranks about to sleep on seq: wake them
  alignas(kLine) std::atomic<std::uint32_t> abort;  // ShmAllreduce::AbortKind
};
static_assert(sizeof(Control) <= kHeaderBytes, "control block outgrew its page");
static_assert(std::atomic<std::uint32_t>::is_always_lock_free,
              "cross-process atomics must be lock-free");

// After the two slots, the point-to-point rings into this rank (shm_ring.h), one per peer
// of its group: a page of control each, then the ring. About 2 MiB per rank whatever the
// group's size (each ring at least 64 KiB), so that /dev/shm (Docker's default: 64 MiB)
// holds them beside the slots.
constexpr std::size_t kRingControlBytes = 4096;
constexpr std::size_t kRingsBytes = 2 << 20;
constexpr std::size_t kRingMinBytes = 64 << 10;
static_assert(sizeof(RingControl) <= kRingControlBytes, "ring control outgrew its page");

std::size_t ring_bytes(int size) {
  if (size < 2) return 0;
  const std::size_t each = kRingsBytes / static_cast<std::size_t>(size - 1) / 4096 * 4096;
  return std::max(kRingMinBytes, each);
}

std::size_t segment_bytes(std::size_t chunk_bytes, int size) {
  return kHeaderBytes + 2 * chunk_bytes +
         static_cast<std::size_t>(std::max(size - 1, 0)) * (kRingControlBytes + ring_bytes(size));
}

// Orders non-temporal stores before the release that publishes what they wrote.
void store_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// Copy this rank's data into a slot its peers read, past the caches (ShmCopy::kStream).
// The peers read the slots of earlier chunks, so their caches hold the lines a plain
// memcpy writes: each line must first be taken back from another core (a read for
// ownership across vCPUs), and on the 2-vCPU development VM that ran the copy at 1-2 GB/s.
// Non-temporal stores write past the caches (12-19 GB/s there; docs/performance.md,
// "Single-host speed"). The fence orders them before the release that publishes the chunk.
void stream_copy(void* dst, const void* src, std::size_t bytes) {
#if defined(__x86_64__)
  if (bytes >= kStreamMinBytes) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    bytes -= head;
    const std::size_t body = bytes / 64 * 64;
    for (std::size_t i = 0; i < body; i += 64) {
      for (std::size_t j = 0; j < 64; j += 16) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + j),
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + j)));
      }
    }
    std::memcpy(d + body, s + body, bytes - body);
    store_fence();
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// dst[i] = src[i] * factor as scale_copy computes it (one IEEE multiplication per element,
// so the same bits), written past the caches as stream_copy writes (the same reason: the
// peers' caches hold the slot's lines), fenced at the end.
template <typename T>
void stream_scale(T* dst, const T* src, std::size_t n, T factor) {
  std::size_t i = 0;
#if defined(__x86_64__)
  if (n * sizeof(T) >= kStreamMinBytes) {
    for (; i < n && reinterpret_cast<std::uintptr_t>(dst + i) % 16 != 0; ++i) dst[i] = src[i] * factor;
    constexpr std::size_t kLanes = 16 / sizeof(T);
    if constexpr (sizeof(T) == 4) {
      const __m128 f = _mm_set1_ps(factor);
      for (; i + kLanes <= n; i += kLanes) {
        _mm_stream_ps(reinterpret_cast<float*>(dst + i),
                      _mm_mul_ps(_mm_loadu_ps(reinterpret_cast<const float*>(src + i)), f));
      }
    } else {
      const __m128d f = _mm_set1_pd(factor);
      for (; i + kLanes <= n; i += kLanes) {
        _mm_stream_pd(reinterpret_cast<double*>(dst + i),
                      _mm_mul_pd(_mm_loadu_pd(reinterpret_cast<const double*>(src + i)), f));
      }
    }
    for (; i < n; ++i) dst[i] = src[i] * factor;
    store_fence();
    return;
  }
#endif
  for (; i < n; ++i) dst[i] = src[i] * factor;
}

// c[i] = a[i] + b[i] as gloo::sum computes it (one IEEE addition per element, so the same
// bits), c written with non-temporal stores; the caller fences (store_fence). The loads
// and stores interleave: measured faster than summing into a cached block and streaming
// that out (docs/performance.md, "The reduction's memory traffic").
template <typename T>
void stream_sum(void* c_, const void* a_, const void* b_, std::size_t n) {
  T* c = static_cast<T*>(c_);
  const T* a = static_cast<const T*>(a_);
  const T* b = static_cast<const T*>(b_);
  std::size_t i = 0;
#if defined(__x86_64__)
  for (; i < n && reinterpret_cast<std::uintptr_t>(c + i) % 16 != 0; ++i) c[i] = a[i] + b[i];
  constexpr std::size_t kLanes = 16 / sizeof(T);
  for (; i + kLanes <= n; i += kLanes) {
    if constexpr (sizeof(T) == 4) {
      _mm_stream_ps(reinterpret_cast<float*>(c + i),
                    _mm_add_ps(_mm_loadu_ps(reinterpret_cast<const float*>(a + i)),
                               _mm_loadu_ps(reinterpret_cast<const float*>(b + i))));
    } else {
      _mm_stream_pd(reinterpret_cast<double*>(c + i),
                    _mm_add_pd(_mm_loadu_pd(reinterpret_cast<const double*>(a + i)),
                               _mm_loadu_pd(reinterpret_cast<const double*>(b + i))));
    }
  }
#endif
  for (; i < n; ++i) c[i] = a[i] + b[i];
}

std::string errno_text(int error) { return std::strerror(error); }

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Field 22 of /proc/<pid>/stat (start time in clock ticks after boot) and field 3 (state),
// or false if the process does not exist.
bool read_stat(long pid, unsigned long long* start_time, char* state) {
  const std::string path =
      pid > 0 ? "/proc/" + std::to_string(pid) + "/stat" : std::string("/proc/self/stat");
  std::ifstream in(path);
  std::string text;
  if (!std::getline(in, text)) return false;
  const auto paren = text.rfind(')');  // the command name may hold spaces and ')'
  if (paren == std::string::npos) return false;
  std::istringstream fields(text.substr(paren + 1));
  std::string field;
  // after ")": field 3 is the state, field 22 the start time
  for (int i = 3; i <= 22 && (fields >> field); ++i) {
    if (i == 3 && state) *state = field.empty() ? '?' : field[0];
    if (i == 22) {
      *start_time = std::strtoull(field.c_str(), nullptr, 10);
      return true;
    }
  }
  return false;
}

std::string default_host_id() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) std::strcpy(name, "?");
  // Host names repeat across clusters and containers; the boot id tells kernels apart.
  return std::string(name) + " " + read_first_line("/proc/sys/kernel/random/boot_id");
}

std::string random_token() {
  std::random_device device;  // getrandom(2) on Linux
  std::uint64_t value = (static_cast<std::uint64_t>(device()) << 32) ^ device();
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

std::string human_bytes(std::size_t bytes) {
  if (bytes % (1 << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes % (1 << 10) == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

}  // namespace

// ---------------------------------------------------------------- segments

struct ShmAllreduce::Segment {
  std::string name;
  void* base = MAP_FAILED;
  std::size_t bytes = 0;
  bool linked = false;  // we created the name and have not unlinked it yet

  Control* control() const { return static_cast<Control*>(base); }
  char* data() const { return static_cast<char*>(base) + kHeaderBytes; }

  void unlink() {
    if (linked) {
      shm_unlink(name.c_str());
      linked = false;
    }
  }

  ~Segment() {
    unlink();
    if (base != MAP_FAILED) munmap(base, bytes);
  }
};

namespace {

using Segment = ShmAllreduce::Segment;

// Our own segment. Throws std::runtime_error saying what went wrong.
std::unique_ptr<Segment> create_segment(const std::string& name, const ShmOptions& o) {
  auto seg = std::make_unique<Segment>();
  seg->name = name;
  seg->bytes = segment_bytes(o.chunk_bytes, o.size);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    throw std::runtime_error("shm_open(" + name + "): " + errno_text(errno));
  }
  seg->linked = true;
  // Reserve the pages now: on a full /dev/shm (Docker's default is 64 MiB) ftruncate
  // alone succeeds and the first store into a missing page kills us with SIGBUS.
  const int error = posix_fallocate(fd, 0, static_cast<off_t>(seg->bytes));
  if (error != 0) {
    close(fd);
    throw std::runtime_error("reserving " + human_bytes(seg->bytes) + " in /dev/shm for " +
                             name + ": " + errno_text(error) +
                             (error == ENOSPC ? " (/dev/shm is full or too small)" : ""));
  }
  seg->base = mmap(nullptr, seg->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_error = errno;
  close(fd);
  if (seg->base == MAP_FAILED) {
    throw std::runtime_error("mmap of " + name + ": " + errno_text(map_error));
  }
  unsigned long long start_time = 0;
  read_stat(0, &start_time, nullptr);
  Control* c = new (seg->base) Control;
  c->magic = kMagic;
  c->rank = static_cast<std::uint32_t>(o.rank);
  c->size = static_cast<std::uint32_t>(o.size);
  c->chunk_bytes = o.chunk_bytes;
  c->pid = getpid();
  c->start_time = start_time;
  c->seq.store(0, std::memory_order_relaxed);
  c->waiters.store(0, std::memory_order_relaxed);
  c->abort.store(0, std::memory_order_release);
  return seg;
}

// A peer's segment, checked against what this rank expects.
std::unique_ptr<Segment> map_segment(const std::string& name, int rank, const ShmOptions& o) {
  auto seg = std::make_unique<Segment>();
  seg->name = name;
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    throw std::runtime_error("cannot open rank " + std::to_string(rank) + "'s segment " +
                             name + ": " + errno_text(errno) +
                             (errno == ENOENT ? " (a different /dev/shm: another container?)"
                                              : ""));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kHeaderBytes)) {
    close(fd);
    throw std::runtime_error("rank " + std::to_string(rank) + "'s segment " + name +
                             " is truncated");
  }
  seg->bytes = static_cast<std::size_t>(st.st_size);
  seg->base = mmap(nullptr, seg->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_error = errno;
  close(fd);
  if (seg->base == MAP_FAILED) {
    throw std::runtime_error("mmap of rank " + std::to_string(rank) + "'s segment: " +
                             errno_text(map_error));
  }
  const Control* c = seg->control();
  if (c->magic != kMagic || c->rank != static_cast<std::uint32_t>(rank) ||
      c->size != static_cast<std::uint32_t>(o.size)) {
    throw std::runtime_error("segment " + name + " does not belong to rank " +
                             std::to_string(rank) + " of this job");
  }
  if (c->chunk_bytes != o.chunk_bytes || seg->bytes != segment_bytes(o.chunk_bytes, o.size)) {
    throw std::runtime_error(
        "rank " + std::to_string(rank) + " uses " + std::to_string(c->chunk_bytes) +
        "-byte chunks, rank " + std::to_string(o.rank) + " " + std::to_string(o.chunk_bytes) +
        " (TNT_GLOO_SHM_CHUNK_BYTES must be the same on every rank)");
  }
  return seg;
}

ShmAllreduce::Peer watch(const Control& c) {
  ShmAllreduce::Peer peer;
  peer.pid = static_cast<long>(c.pid);
  peer.start_time = c.start_time;
#ifdef SYS_pidfd_open
  peer.pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(peer.pid), 0));
#endif
  // Only trust the pid if it names the same process here (same pid namespace): the
  // start time, read after pidfd_open so the pidfd cannot name a later process either.
  unsigned long long start_time = 0;
  char state = '?';
  peer.verified = read_stat(peer.pid, &start_time, &state) && start_time == c.start_time;
  if (!peer.verified && peer.pidfd >= 0) {
    close(peer.pidfd);
    peer.pidfd = -1;
  }
  return peer;
}

bool exited(const ShmAllreduce::Peer& peer) {
  if (!peer.verified) return false;  // cannot tell; the deadline still holds
  if (peer.pidfd >= 0) {
    pollfd pfd{peer.pidfd, POLLIN, 0};
    return poll(&pfd, 1, 0) > 0;
  }
  unsigned long long start_time = 0;
  char state = '?';
  if (!read_stat(peer.pid, &start_time, &state)) return true;
  return start_time != peer.start_time || state == 'Z' || state == 'X';
}

// One round of the set-up: every rank publishes `mine`, gets everybody's, by rank.
std::vector<std::string> exchange(gloo::rendezvous::Store& store, const ShmOptions& o,
                                  const std::string& round, const std::string& mine) {
  store.set("shm/" + round + "/" + std::to_string(o.rank),
            std::vector<char>(mine.begin(), mine.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < o.size; ++r) keys.push_back("shm/" + round + "/" + std::to_string(r));
  store.wait(keys, o.timeout);
  std::vector<std::string> values;
  for (const auto& key : keys) {
    const auto value = store.get(key);
    values.emplace_back(value.begin(), value.end());
  }
  return values;
}

// The first rank whose status is not "ok...", with its message; -1 if none.
int first_failure(const std::vector<std::string>& statuses, std::string* message) {
  for (std::size_t r = 0; r < statuses.size(); ++r) {
    if (statuses[r].rfind("ok", 0) != 0) {
      *message = statuses[r].size() > 6 ? statuses[r].substr(6) : statuses[r];  // "error "
      return static_cast<int>(r);
    }
  }
  return -1;
}

const char* mode_name(ShmMode mode) {
  switch (mode) {
    case ShmMode::kOff: return "0";
    case ShmMode::kAuto: return "auto";
    case ShmMode::kRequired: return "1";
  }
  return "?";
}

}  // namespace

ShmSetup setup_shm(const ShmOptions& o, gloo::rendezvous::Store& store) {
  ShmSetup out;
  if (o.size < 2) {
    out.reason = "a single rank";
    return out;
  }
  // Round 1: "<mode> <hierarchy mode> <host id>" from every rank. Even with the setting
  // off a rank takes part, so that a setting that differs between ranks cannot leave
  // some waiting.
  const std::string host = o.host_id.empty() ? default_host_id() : o.host_id;
  const auto hosts = exchange(store, o, "host",
                              std::string(mode_name(o.mode)) + " " +
                                  mode_name(o.hierarchy) + " " + host);
  for (int r = 0; r < o.size; ++r) {
    if (hosts[r].rfind("0 ", 0) == 0) {
      out.reason = "TNT_GLOO_SHM=0 on rank " + std::to_string(r);
      return out;
    }
  }
  auto host_of = [&](int r) { return hosts[r].substr(hosts[r].find(' ', hosts[r].find(' ') + 1) + 1); };
  auto hierarchy_of = [&](int r) { return hosts[r].substr(hosts[r].find(' ') + 1, 1); };
  // Hosts in the order of their lowest rank; the ranks on each in rank order.
  std::vector<std::string> host_ids;
  std::vector<std::vector<int>> members;
  std::vector<int> host_index(static_cast<std::size_t>(o.size));
  for (int r = 0; r < o.size; ++r) {
    const auto it = std::find(host_ids.begin(), host_ids.end(), host_of(r));
    host_index[r] = static_cast<int>(it - host_ids.begin());
    if (it == host_ids.end()) {
      host_ids.push_back(host_of(r));
      members.emplace_back();
    }
    members[host_index[r]].push_back(r);
  }
  std::vector<int> group = members[0];  // the ranks this rank's segments are shared with
  if (host_ids.size() > 1) {
    const int other = members[1][0];
    out.reason = "the ranks are not all on one host (rank 0: '" + host_of(0) + "', rank " +
                 std::to_string(other) + ": '" + host_of(other) + "')";
    for (int r = 0; r < o.size; ++r) {
      if (hierarchy_of(r) == "0") {
        out.reason += "; TNT_GLOO_HIERARCHY=0 on rank " + std::to_string(r);
        return out;
      }
    }
    std::size_t most = 0;
    for (const auto& ranks : members) most = std::max(most, ranks.size());
    if (most < 2) {
      out.reason += "; one rank per host, so nothing to share";
      return out;
    }
    for (std::size_t h = 1; h < members.size(); ++h) {
      if (members[h].size() != members[0].size()) {
        out.reason += "; the hierarchical allreduce needs as many ranks on every host, and "
                      "rank 0's host has " + std::to_string(members[0].size()) +
                      ", rank " + std::to_string(members[h][0]) + "'s " +
                      std::to_string(members[h].size());
        return out;
      }
    }
    group = members[host_index[o.rank]];
    out.hierarchical = true;
    HostLayout& layout = out.layout;
    layout.hosts = static_cast<int>(members.size());
    layout.host_index = host_index[o.rank];
    layout.local_size = static_cast<int>(group.size());
    layout.local_rank =
        static_cast<int>(std::find(group.begin(), group.end(), o.rank) - group.begin());
    layout.local_ranks = group;
    for (const auto& ranks : members) layout.cross_ranks.push_back(ranks[layout.local_rank]);
  }
  // This rank among the ranks of its group: what its segment says and is checked against.
  ShmOptions local = o;
  local.size = static_cast<int>(group.size());
  local.rank = static_cast<int>(std::find(group.begin(), group.end(), o.rank) - group.begin());
  // Round 2: every rank creates its segment and says how that went.
  std::vector<std::unique_ptr<Segment>> segments(group.size());
  std::string status;
  const std::string name =
      "/" + o.name_prefix + "r" + std::to_string(o.rank) + "-" + random_token();
  try {
    segments[local.rank] = create_segment(name, local);
    status = "ok " + name;
  } catch (const std::exception& e) {
    status = std::string("error ") + e.what();
  }
  auto failed_setup = [&out](std::string reason) {
    out.reason = std::move(reason);
    out.hierarchical = false;
    out.layout = HostLayout();
    return out;
  };
  const auto created = exchange(store, o, "created", status);
  std::string message;
  int failed = first_failure(created, &message);
  if (failed >= 0) {
    // our segment, if any, is unlinked and unmapped on return
    return failed_setup("rank " + std::to_string(failed) +
                        " could not create its segment: " + message);
  }
  // Round 3: every rank maps the segments of its group. Once all have reported, every
  // name has been opened by everyone who needs it: unlink ours, so that nothing is left
  // in /dev/shm whatever happens to this process later.
  try {
    for (int l = 0; l < local.size; ++l) {
      if (l != local.rank) segments[l] = map_segment(created[group[l]].substr(3), l, local);
    }
    status = "ok";
  } catch (const std::exception& e) {
    status = std::string("error ") + e.what();
  }
  const auto mapped = exchange(store, o, "mapped", status);
  segments[local.rank]->unlink();
  failed = first_failure(mapped, &message);
  if (failed >= 0) {
    return failed_setup("rank " + std::to_string(failed) + " could not map the segments: " +
                        message);
  }
  std::vector<ShmAllreduce::Peer> peers(group.size());
  for (int l = 0; l < local.size; ++l) {
    if (l != local.rank) peers[l] = watch(*segments[l]->control());
  }
  out.reason.clear();
  out.shm = std::make_shared<ShmAllreduce>(local, std::move(segments), std::move(peers),
                                           std::move(group));
  return out;
}

// ---------------------------------------------------------------- ShmAllreduce

ShmAllreduce::ShmAllreduce(const ShmOptions& options,
                           std::vector<std::unique_ptr<Segment>> segments,
                           std::vector<Peer> peers, std::vector<int> names)
    : rank_(options.rank),
      size_(options.size),
      chunk_bytes_(options.chunk_bytes),
      spin_(std::chrono::microseconds(options.spin_us >= 0 ? options.spin_us : kDefaultSpinUs)),
      owner_pid_(getpid()),
      own_name_(segments[options.rank]->name),
      segments_(std::move(segments)),
      peers_(std::move(peers)),
      names_(std::move(names)),
      copy_(options.copy) {}

ShmAllreduce::~ShmAllreduce() {
  for (auto& peer : peers_) {
    if (peer.pidfd >= 0) close(peer.pidfd);
  }
}

char* ShmAllreduce::slot(int rank, unsigned index) const {
  return segments_[rank]->data() + index * chunk_bytes_;
}

const char* ShmAllreduce::copy_mode() const {
  switch (copy_.load(std::memory_order_relaxed)) {
    case ShmCopy::kStream: return "stream";
    case ShmCopy::kCache: return "cache";
    case ShmCopy::kAuto: break;
  }
  return "auto";
}

namespace {
double median(std::vector<double> values) {
  auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  return *middle;
}
}  // namespace

template <typename Stream, typename Cached>
void ShmAllreduce::write_slot(std::size_t bytes, Stream&& stream, Cached&& cached) {
  const ShmCopy mode = copy_.load(std::memory_order_relaxed);
  if (mode == ShmCopy::kCache) {
    cached();
    return;
  }
  if (mode == ShmCopy::kStream || bytes < kTimingMinBytes) {
    stream();
    return;
  }
  // Timing (kAuto): the two ways in turn, each on its own data, so that both meet the
  // same load. The write's own time is what is compared: the peers' reads of the slot
  // follow the same way (measured by benchmarks/shm_copy.c: memory or another cache).
  const bool streamed = timed_copies_ % 2 == 0;
  const auto start = Clock::now();
  if (streamed) {
    stream();
  } else {
    cached();
  }
  const double ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
  if (timed_copies_++ < kTimingWarmup) return;
  timed_[streamed ? 0 : 1].push_back(ns / static_cast<double>(bytes));
  if (timed_[0].size() >= kTimingSamples && timed_[1].size() >= kTimingSamples) {
    const bool cache = median(timed_[1]) < median(timed_[0]);
    copy_.store(cache ? ShmCopy::kCache : ShmCopy::kStream, std::memory_order_relaxed);
    timed_[0] = {};
    timed_[1] = {};
  }
}

void ShmAllreduce::copy_in(void* dst, const void* src, std::size_t bytes) {
  write_slot(bytes, [&] { stream_copy(dst, src, bytes); }, [&] { std::memcpy(dst, src, bytes); });
}

void ShmAllreduce::scale_in(void* dst, const void* src, std::size_t n, double factor,
                            DType dtype) {
  const auto cached = [&] { scale_copy(dtype, dst, src, n, factor); };
  const auto streamed = [&](auto type) {
    using T = decltype(type);
    write_slot(n * sizeof(T), [&] {
      stream_scale(static_cast<T*>(dst), static_cast<const T*>(src), n, static_cast<T>(factor));
    }, cached);
  };
  if (dtype == DType::kFloat32) {
    streamed(float{});
  } else if (dtype == DType::kFloat64) {
    streamed(double{});
  } else {
    cached();
  }
}

void ShmAllreduce::publish(std::uint32_t value) {
  Control& c = *segments_[rank_]->control();
  // seq_cst on both sides (here: store seq, load waiters; the waiter: add to waiters,
  // load seq) so that either we see the waiter or it sees the new value: a sleeper is
  // never missed, and the fast path makes no system call.
  c.seq.store(value, std::memory_order_seq_cst);
  if (c.waiters.load(std::memory_order_seq_cst) != 0) futex_wake(&c.seq);
}

std::string ShmAllreduce::check_peers(int waiting_for, std::chrono::milliseconds timeout,
                                      Clock::time_point deadline, bool liveness) {
  int aborted = -1;
  for (int r = 0; r < size_ && aborted < 0; ++r) {
    if (segments_[r]->control()->abort.load(std::memory_order_acquire) != kNotAborted) {
      aborted = r;
    }
  }
  const bool late = Clock::now() >= deadline;
  // An abort is usually a peer's reaction to another peer's exit: name the root cause.
  if (liveness || late || aborted >= 0) {
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && exited(peers_[r])) {
        return "rank " + std::to_string(names_[r]) + " (pid " + std::to_string(peers_[r].pid) +
               ") exited during the shared-memory allreduce";
      }
    }
  }
  if (aborted == rank_) {
    return "the shared-memory allreduce was aborted: this rank's communicator failed or is "
           "being closed";
  }
  if (aborted >= 0) {
    const bool closed =
        segments_[aborted]->control()->abort.load(std::memory_order_acquire) == kClosed;
    return "rank " + std::to_string(names_[aborted]) + " (pid " +
           std::to_string(peers_[aborted].pid) +
           ") " + (closed ? "closed its communicator" : "failed (its communicator is poisoned)") +
           " during the shared-memory allreduce";
  }
  if (late) {
    std::ostringstream text;
    text << "rank " << names_[waiting_for] << " (pid " << peers_[waiting_for].pid
         << ") did not arrive within " << std::chrono::duration<double>(timeout).count()
         << "s (TNT_TIMEOUT_S) in the shared-memory allreduce; it may be hung";
    return text.str();
  }
  return std::string();
}

void ShmAllreduce::wait_for_peer(int peer, std::uint32_t target, Clock::time_point deadline,
                                 std::chrono::milliseconds timeout) {
  Control& c = *segments_[peer]->control();
  auto arrived = [&c, target] {
    // modulo 2^32: sequence numbers wrap, peers are never 2^31 phases apart
    return static_cast<std::int32_t>(c.seq.load(std::memory_order_acquire) - target) >= 0;
  };
  if (spin_until(arrived, spin_)) return;
  // Sleep in slices; between them look for the deadline, exits and aborts.
  auto next_liveness = Clock::now() + kSlice;
  for (;;) {
    const auto now = Clock::now();
    const bool liveness = now >= next_liveness;
    if (liveness) next_liveness = now + kSlice;
    const std::string problem = check_peers(peer, timeout, deadline, liveness);
    // Looked at after the flags: a peer publishes before it exits or closes, so a peer
    // that finished this operation and left is not mistaken for a failure.
    if (arrived()) return;
    if (!problem.empty()) throw GlooError(problem);
    c.waiters.fetch_add(1, std::memory_order_seq_cst);
    const std::uint32_t seen = c.seq.load(std::memory_order_seq_cst);
    if (static_cast<std::int32_t>(seen - target) < 0) {
      futex_wait(&c.seq, seen,
                 std::min<std::chrono::nanoseconds>(
                     kSlice, deadline - now + std::chrono::milliseconds(1)));
    }
    c.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (arrived()) return;
  }
}

void ShmAllreduce::allreduce(void* data, std::size_t count, DType dtype, ReduceOp op,
                             std::chrono::milliseconds timeout) {
  run(data, count, dtype, op, timeout, nullptr);
}

void ShmAllreduce::allreduce_gather(const std::vector<Piece>& pieces, double factor, void* out,
                                    std::size_t count, DType dtype, ReduceOp op,
                                    std::chrono::milliseconds timeout) {
  const Fill fill = [&](char* slot_chunk, std::size_t first, std::size_t n) {
    fill_gathered(slot_chunk, first, n, pieces, factor, dtype,
                  [this](void* dst, const void* src, std::size_t bytes) { copy_in(dst, src, bytes); },
                  [this, dtype](void* dst, const void* src, std::size_t count, double f) {
                    scale_in(dst, src, count, f, dtype);
                  });
  };
  run(out, count, dtype, op, timeout, &fill);
}

void ShmAllreduce::run(void* data, std::size_t count, DType dtype, ReduceOp op,
                       std::chrono::milliseconds timeout, const Fill* fill) {
  if (count == 0) return;
  const auto reduce = reduce_function(dtype, op);
  const std::size_t es = element_size(dtype);
  const std::size_t per_chunk = chunk_bytes_ / es;
  const auto deadline = Clock::now() + timeout;
  char* const user = static_cast<char*>(data);
  // two ranks always reduce whole chunks (below): a large sum of floats is streamed out
  using Sum = void (*)(void*, const void*, const void*, std::size_t);
  Sum streamed = nullptr;
  if (size_ == 2 && op == ReduceOp::kSum && count * es >= kStreamOutMinBytes) {
    if (dtype == DType::kFloat32) streamed = &stream_sum<float>;
    if (dtype == DType::kFloat64) streamed = &stream_sum<double>;
  }
  auto wait_all = [&](std::uint32_t target) {
    for (int k = 1; k < size_; ++k) wait_for_peer((rank_ + k) % size_, target, deadline, timeout);
  };
  for (std::size_t first = 0; first < count; first += per_chunk) {
    const std::size_t n = std::min(per_chunk, count - first);
    // Chunks alternate between the two slots: copying chunk k+1 in may overlap peers
    // still reading chunk k. Reuse is safe without a wait of its own: a slot is written
    // again two chunks later, after every peer published "data in" for the chunk in
    // between, which each does only after consuming the older one.
    const unsigned s = static_cast<unsigned>(next_chunk_++ & 1);
    const std::uint32_t base = next_seq_;
    next_seq_ += 3;
    char* const out = user + first * es;
    if (fill == nullptr) {
      copy_in(slot(rank_, s), out, n * es);
    } else {
      (*fill)(slot(rank_, s), first, n);
    }
    publish(base + 1);  // data in
    wait_all(base + 1);
    // Every element is reduced once, in rank order (numpy's order for a reduction over
    // the ranks), by one rank, and copied by the others: bitwise the same everywhere.
    // When `out` holds this rank's input (not gathered), its own slot holds the same:
    // read `out`, still in this core's cache, rather than the slot (which a streaming
    // copy bypassed).
    // (Ranks from 2 on read their own slot: `out` holds the sum of ranks 0 and 1 by then.)
    char* const mine = fill == nullptr ? out : slot(rank_, s);
    auto from = [&](int r) -> const char* { return r < 2 && r == rank_ ? mine : slot(r, s); };
    if (streamed != nullptr) {
      streamed(out, from(0), from(1), n);
    } else if (size_ == 2 || n * es <= kWholeMaxBytes) {
      reduce(out, from(0), from(1), n);
      for (int r = 2; r < size_; ++r) reduce(out, out, from(r), n);
    } else {
      // Reduce-scatter: rank r reduces part r into its buffer and publishes it in its
      // own slot (nobody else reads part r of that slot until then); then everyone
      // gathers. Parts are whole cache lines so no two ranks write one line.
      const std::size_t line = kLine / es;
      const std::size_t part = ((n + size_ - 1) / size_ + line - 1) / line * line;
      auto lo = [&](int r) { return std::min(n, static_cast<std::size_t>(r) * part); };
      const std::size_t a = lo(rank_), b = lo(rank_ + 1);
      if (b > a) {
        const std::size_t off = a * es;
        reduce(out + off, slot(0, s) + off, slot(1, s) + off, b - a);
        for (int r = 2; r < size_; ++r) reduce(out + off, out + off, slot(r, s) + off, b - a);
        copy_in(slot(rank_, s) + off, out + off, (b - a) * es);
      }
      publish(base + 2);  // part reduced
      wait_all(base + 2);
      for (int k = 1; k < size_; ++k) {
        const int r = (rank_ + k) % size_;
        const std::size_t ra = lo(r), rb = lo(r + 1);
        if (rb > ra) std::memcpy(out + ra * es, slot(r, s) + ra * es, (rb - ra) * es);
      }
    }
    publish(base + 3);  // consumed: our reads of this chunk's slots are done
  }
  // the streamed result visible before the caller learns that the allreduce is done
  if (streamed != nullptr) store_fence();
}

std::pair<std::size_t, std::size_t> ShmAllreduce::slice(std::size_t count, int parts,
                                                       int index) {
  const std::size_t p = static_cast<std::size_t>(parts), i = static_cast<std::size_t>(index);
  const std::size_t base = count / p, extra = count % p;
  const std::size_t first = i * base + std::min(i, extra);
  return {first, first + base + (i < extra ? 1 : 0)};
}

void ShmAllreduce::reduce_scatter(void* data, std::size_t count, DType dtype, ReduceOp op,
                                  std::chrono::milliseconds timeout,
                                  Clock::time_point deadline) {
  slices(true, data, count, dtype, op, timeout, deadline);
}

void ShmAllreduce::allgather(void* data, std::size_t count, DType dtype,
                             std::chrono::milliseconds timeout, Clock::time_point deadline) {
  slices(false, data, count, dtype, ReduceOp::kSum, timeout, deadline);
}

void ShmAllreduce::slices(bool reduce_step, void* data, std::size_t count, DType dtype,
                          ReduceOp op, std::chrono::milliseconds timeout,
                          Clock::time_point deadline) {
  if (count == 0 || size_ < 2) return;
  const auto reduce = reduce_function(dtype, op);
  const std::size_t es = element_size(dtype);
  // A slot holds one piece of every slice, piece j at j * piece_bytes (whole cache
  // lines, so no two ranks write one line), so every rank has work in every chunk.
  std::size_t piece_bytes = chunk_bytes_ / static_cast<std::size_t>(size_) / kLine * kLine;
  if (piece_bytes < es) piece_bytes = chunk_bytes_ / static_cast<std::size_t>(size_);
  const std::size_t per_piece = piece_bytes / es;
  const std::size_t longest = slice(count, size_, 0).second;  // slice 0 is the longest
  char* const user = static_cast<char*>(data);
  // Piece `step` of slice `r`: [first, first + n) elements, n == 0 past its end.
  auto piece = [&](int r, std::size_t step, std::size_t* n) {
    const auto range = slice(count, size_, r);
    const std::size_t first = range.first + step * per_piece;
    *n = first < range.second ? std::min(per_piece, range.second - first) : 0;
    return first;
  };
  for (std::size_t step = 0; step * per_piece < longest; ++step) {
    // Slots alternate and one phase per chunk suffices: a rank publishes chunk k+1's
    // "data in" only after its reads of chunk k, and a slot is written again two chunks
    // later, after everybody's "data in" of the chunk in between.
    const unsigned s = static_cast<unsigned>(next_chunk_++ & 1);
    const std::uint32_t target = ++next_seq_;
    std::size_t n = 0;
    if (reduce_step) {
      for (int r = 0; r < size_; ++r) {
        const std::size_t first = piece(r, step, &n);
        if (n > 0) copy_in(slot(rank_, s) + r * piece_bytes, user + first * es, n * es);
      }
    } else {
      const std::size_t first = piece(rank_, step, &n);
      if (n > 0) {
        copy_in(slot(rank_, s) + rank_ * piece_bytes, user + first * es, n * es);
      }
    }
    publish(target);  // data in
    for (int k = 1; k < size_; ++k) wait_for_peer((rank_ + k) % size_, target, deadline, timeout);
    if (reduce_step) {
      // Our piece, reduced in rank order from every slot (ours included).
      const std::size_t first = piece(rank_, step, &n);
      if (n > 0) {
        char* const out = user + first * es;
        const std::size_t off = rank_ * piece_bytes;
        reduce(out, slot(0, s) + off, slot(1, s) + off, n);
        for (int r = 2; r < size_; ++r) reduce(out, out, slot(r, s) + off, n);
      }
    } else {
      for (int k = 1; k < size_; ++k) {
        const int r = (rank_ + k) % size_;
        const std::size_t first = piece(r, step, &n);
        if (n > 0) std::memcpy(user + first * es, slot(r, s) + r * piece_bytes, n * es);
      }
    }
  }
}

std::string ShmAllreduce::failure() {
  // no deadline here: the caller keeps its own
  return check_peers(rank_, std::chrono::milliseconds(0), Clock::time_point::max(),
                     /*liveness=*/true);
}

void ShmAllreduce::abort(AbortKind kind) noexcept {
  // A forked child shares our mapping but is not this rank: its exit handlers closing
  // the inherited communicator must not fail the job.
  if (getpid() != owner_pid_) return;
  std::uint32_t expected = kNotAborted;
  segments_[rank_]->control()->abort.compare_exchange_strong(expected, kind,
                                                            std::memory_order_acq_rel);
  // Sleepers on any word re-check every abort flag when woken: wake them all, ours too.
  for (auto& seg : segments_) futex_wake(&seg->control()->seq);
}

int ShmAllreduce::local_of(int comm_rank) const {
  for (int r = 0; r < size_; ++r) {
    if (names_[r] == comm_rank) return r;
  }
  return -1;
}

ShmRing ShmAllreduce::ring(int from, int to) const {
  // `to`'s segment holds a ring per peer, in their order without `to` itself
  const int index = from < to ? from : from - 1;
  const std::size_t each = kRingControlBytes + ring_bytes(size_);
  char* base = segments_[to]->data() + 2 * chunk_bytes_ + static_cast<std::size_t>(index) * each;
  return ShmRing(reinterpret_cast<RingControl*>(base), base + kRingControlBytes, ring_bytes(size_));
}

std::string ShmAllreduce::peer_gone(int peer) const {
  const std::uint32_t abort = segments_[peer]->control()->abort.load(std::memory_order_acquire);
  const std::string who =
      "rank " + std::to_string(names_[peer]) + " (pid " + std::to_string(peers_[peer].pid) + ")";
  if (exited(peers_[peer])) return who + " exited";
  if (abort == kClosed) return who + " closed its communicator";
  if (abort != kNotAborted) return who + " failed (its communicator is poisoned)";
  return std::string();
}

}  // namespace tnt_gloo
