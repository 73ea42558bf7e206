// tnt_comm_gloo._gloo: the private native module. It moves bytes; policy (algorithm
// choice, addresses, timeouts, error wording) lives in tnt_comm_gloo/backend.py.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/vector.h>

#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "communicator.h"
#include "cuda_staging.h"
#include "errors.h"
#include "gloo_compat.h"
#include "native_comm.h"
#include "types.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace tnt_gloo {
namespace {

using HostArray = nb::ndarray<nb::c_contig, nb::device::cpu>;
using ReadOnlyHostArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

// ----------------------------------------------------------- rendezvous store

// gloo::rendezvous::Store over a Python object with set(key, bytes), get(key) -> bytes
// and wait(keys, timeout_s): tnt_core.StoreClient, which speaks the launcher's
// authenticated protocol. Gloo calls it from the thread building the mesh, which does
// not hold the GIL; each call takes the GIL for the Python call only.
class PythonStore : public gloo::rendezvous::Store {
 public:
  PythonStore(nb::object client, std::chrono::milliseconds timeout)
      : client_(std::move(client)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    nb::gil_scoped_acquire gil;
    call("set " + key, [&] { client_.attr("set")(key, nb::bytes(data.data(), data.size())); });
  }

  std::vector<char> get(const std::string& key) override {
    nb::gil_scoped_acquire gil;
    std::vector<char> out;
    call("get " + key, [&] {
      nb::bytes value(client_.attr("get")(key, seconds(timeout_)));
      out.assign(value.c_str(), value.c_str() + value.size());
    });
    return out;
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    nb::gil_scoped_acquire gil;
    call("wait", [&] {
      nb::list names;
      for (const auto& key : keys) names.append(nb::str(key.c_str(), key.size()));
      client_.attr("wait")(names, seconds(timeout));
    });
  }

  // Drops the Python client (call with the GIL). Gloo's TCP context keeps the store after
  // the mesh is built (for pairs it would connect lazily, which this module never asks
  // for), so the store can outlive connect() and be destroyed on a thread without the GIL:
  // it must hold no Python object by then. Later calls fail with GlooError.
  void close() { client_ = nb::object(); }

 private:
  static double seconds(std::chrono::milliseconds ms) {
    return ms.count() > 0 ? static_cast<double>(ms.count()) / 1000.0 : 0.0;
  }

  // Python errors become GlooError here, with the GIL still held: no Python object
  // travels through Gloo's frames.
  template <typename Fn>
  void call(const std::string& what, Fn&& fn) {
    if (!client_.is_valid()) throw GlooError("rendezvous store " + what + ": the store is closed");
    try {
      fn();
    } catch (nb::python_error& e) {
      std::string message;
      try {
        message = nb::cast<std::string>(nb::str(e.value()));
      } catch (...) {
        message = e.what();
      }
      throw GlooError("rendezvous store " + what + ": " + message);
    }
  }

  nb::object client_;
  std::chrono::milliseconds timeout_;
};

std::chrono::milliseconds to_ms(double seconds, const char* what) {
  if (!(seconds > 0.0) || !std::isfinite(seconds)) {
    throw std::invalid_argument(std::string(what) + " must be a positive number of seconds");
  }
  return std::chrono::milliseconds(static_cast<long long>(std::ceil(seconds * 1000.0)));
}

// ----------------------------------------------------------- buffers

DType dtype_of(const nb::dlpack::dtype& dt) {
  if (dt.lanes == 1) {
    if (dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)) {
      if (dt.bits == 16) return DType::kFloat16;
      if (dt.bits == 32) return DType::kFloat32;
      if (dt.bits == 64) return DType::kFloat64;
    } else if (dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int)) {
      if (dt.bits == 32) return DType::kInt32;
      if (dt.bits == 64) return DType::kInt64;
    }
  }
  throw std::invalid_argument("unsupported element type (code " + std::to_string(dt.code) + ", " +
                  std::to_string(dt.bits) + " bits); use float16/32/64 or int32/64");
}

// The part of a DLPack capsule a staged collective needs.
struct DeviceTensor {
  void* data = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  int device_type = 0;
  int device_id = 0;
};

DeviceTensor parse_capsule(nb::handle capsule) {
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
    throw std::invalid_argument(
        "expected an unconsumed DLPack capsule named 'dltensor' (from obj.__dlpack__())");
  }
  auto* managed =
      static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  const dlpack::Tensor& t = managed->dl_tensor;
  DeviceTensor out;
  out.device_type = t.device.device_type;
  out.device_id = t.device.device_id;
  nb::dlpack::dtype dt;
  dt.code = t.dtype.code;
  dt.bits = t.dtype.bits;
  dt.lanes = t.dtype.lanes;
  out.dtype = dtype_of(dt);
  std::size_t count = 1;
  std::int64_t expected_stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    const std::int64_t extent = t.shape[d];
    if (t.strides != nullptr && extent != 1 && t.strides[d] != expected_stride) {
      throw std::invalid_argument(
          "the DLPack tensor is not C-contiguous; pass a contiguous tensor "
          "(e.g. tensor.contiguous())");
    }
    expected_stride *= extent;
    count *= static_cast<std::size_t>(extent);
  }
  out.count = count;
  out.data = static_cast<char*>(t.data) + t.byte_offset;
  return out;
}

// ----------------------------------------------------------- the Python-facing object

class PyCommunicator {
 public:
  PyCommunicator(std::unique_ptr<Communicator> comm)
      : comm_(std::move(comm)), staging_(std::make_shared<StagingBuffer>()) {}

  Communicator& comm() { return *comm_; }

  std::shared_ptr<Work> allreduce(HostArray buf, const std::string& op,
                                  const std::string& algorithm, std::string name) {
    void* data = buf.data();
    const std::size_t count = buf.size();
    const DType dtype = dtype_of(buf.dtype());
    const ReduceOp rop = parse_op(op);
    const Algorithm algo = parse_algorithm(algorithm);
    return comm_->submit(std::move(name), [=](const Exec& exec) {
      run_allreduce(exec, data, count, dtype, rop, algo);
    });
  }

  std::shared_ptr<Work> allreduce_dlpack(nb::handle capsule, const std::string& op,
                                         const std::string& algorithm, std::string name) {
    const DeviceTensor t = parse_capsule(capsule);
    const ReduceOp rop = parse_op(op);
    const Algorithm algo = parse_algorithm(algorithm);
    const std::size_t nbytes = t.count * element_size(t.dtype);
    switch (t.device_type) {
      case dlpack::kCPU:
        return comm_->submit(std::move(name), [=](const Exec& exec) {
          run_allreduce(exec, t.data, t.count, t.dtype, rop, algo);
        });
      case dlpack::kCUDAHost: {  // pinned host memory: reduced in place once the GPU is done
        CudaRuntime::get();
        return comm_->submit(std::move(name), [=](const Exec& exec) {
          auto& cuda = CudaRuntime::get();
          cuda.set_device(t.device_id);
          cuda.synchronize();
          run_allreduce(exec, t.data, t.count, t.dtype, rop, algo);
        }, /*inline_ok=*/false);
      }
      case dlpack::kCUDA:
      case dlpack::kCUDAManaged: {
        CudaRuntime::get();  // fail now, on the caller's thread, if CUDA is missing
        auto staging = staging_;
        return comm_->submit(std::move(name), [=](const Exec& exec) {
          if (nbytes == 0) return;
          auto& cuda = CudaRuntime::get();
          cuda.set_device(t.device_id);
          void* host = staging->reserve(nbytes);
          cuda.copy_to_host(host, t.data, nbytes);
          run_allreduce(exec, host, t.count, t.dtype, rop, algo);
          cuda.copy_to_device(t.data, host, nbytes);
        }, /*inline_ok=*/false);  // cudaSetDevice must not touch the caller's thread
      }
      default:
        throw std::invalid_argument("DLPack device type " + std::to_string(t.device_type) +
                        " is not supported; tnt-comm-gloo takes CPU and CUDA buffers");
    }
  }

  std::shared_ptr<Work> broadcast(HostArray buf, int root, std::string name) {
    if (root < 0 || root >= comm_->size()) {
      throw std::invalid_argument("broadcast root " + std::to_string(root) + " is not a rank in [0, " +
                      std::to_string(comm_->size()) + ")");
    }
    void* data = buf.data();
    const std::size_t nbytes = buf.nbytes();
    return comm_->submit(std::move(name), [=](const Exec& exec) {
      run_broadcast(exec, data, nbytes, root);
    });
  }

  std::shared_ptr<Work> allgather(ReadOnlyHostArray in, HostArray out, std::string name) {
    const std::size_t nbytes = in.nbytes();
    if (out.nbytes() != nbytes * static_cast<std::size_t>(comm_->size())) {
      throw std::invalid_argument("allgather output must hold size * input bytes");
    }
    const void* src = in.data();
    void* dst = out.data();
    return comm_->submit(std::move(name), [=](const Exec& exec) {
      run_allgather(exec, src, dst, nbytes);
    });
  }

  // Point-to-point: posted from this thread (GIL released: the post may wait for a pair's
  // lock while Gloo's I/O thread moves another message), completed beside the worker.
  std::shared_ptr<Work> send(ReadOnlyHostArray buf, int dest, std::uint64_t tag,
                             std::string name) {
    const void* data = buf.data();
    const std::size_t nbytes = buf.nbytes();
    nb::gil_scoped_release release;
    return comm_->send(data, nbytes, dest, tag, std::move(name));
  }

  std::shared_ptr<Work> recv(HostArray buf, int src, std::uint64_t tag, std::string name) {
    void* data = buf.data();
    const std::size_t nbytes = buf.nbytes();
    nb::gil_scoped_release release;
    return comm_->recv(data, nbytes, src, tag, std::move(name));
  }

  std::shared_ptr<Work> barrier(std::string name) {
    return comm_->submit(std::move(name), [](const Exec& exec) { run_barrier(exec); });
  }

  std::vector<double> time_direct_allreduce(HostArray buf, const std::string& algorithm,
                                            int iters) {
    void* data = buf.data();
    const std::size_t count = buf.size();
    const DType dtype = dtype_of(buf.dtype());
    const bool shm = algorithm == "shm";
    const Algorithm algo = shm ? Algorithm::kRing : parse_algorithm(algorithm);
    nb::gil_scoped_release release;
    return comm_->time_direct_allreduce(data, count, dtype, algo, iters, shm);
  }

 private:
  std::unique_ptr<Communicator> comm_;
  std::shared_ptr<StagingBuffer> staging_;
};

ShmMode parse_shm_mode(const std::string& mode) {
  if (mode == "auto") return ShmMode::kAuto;
  if (mode == "0") return ShmMode::kOff;
  if (mode == "1") return ShmMode::kRequired;
  throw std::invalid_argument("mode must be 'auto', '0' or '1', not '" + mode + "'");
}

ShmCopy parse_shm_copy(const std::string& copy) {
  if (copy == "auto") return ShmCopy::kAuto;
  if (copy == "stream") return ShmCopy::kStream;
  if (copy == "cache") return ShmCopy::kCache;
  throw std::invalid_argument("shm_copy must be 'auto', 'stream' or 'cache', not '" + copy + "'");
}

std::unique_ptr<PyCommunicator> connect(int rank, int size, nb::object store_client,
                                        const std::string& file_store, const std::string& prefix,
                                        const std::string& hostname, const std::string& iface,
                                        double timeout_s, const std::string& shm,
                                        const std::string& shm_prefix,
                                        const std::string& shm_host_id,
                                        std::size_t shm_chunk_bytes, int shm_spin_us,
                                        const std::string& hierarchy,
                                        const std::string& shm_copy) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw std::invalid_argument("rank " + std::to_string(rank) + " is not in [0, " +
                    std::to_string(size) + ")");
  }
  if (store_client.is_none() == file_store.empty()) {
    throw std::invalid_argument("give exactly one of a store client or a file store directory");
  }
  if (hostname.empty() && iface.empty()) {
    throw std::invalid_argument("give a hostname or a network interface to listen on");
  }
  ConnectOptions options;
  options.rank = rank;
  options.size = size;
  options.hostname = hostname;
  options.iface = iface;
  options.timeout = to_ms(timeout_s, "timeout");
  options.shm.mode = parse_shm_mode(shm);
  options.shm.hierarchy = parse_shm_mode(hierarchy);
  if (shm_prefix.empty() || shm_prefix.find('/') != std::string::npos) {
    throw std::invalid_argument("shm_prefix must be a non-empty name without '/'");
  }
  options.shm.name_prefix = shm_prefix;
  options.shm.host_id = shm_host_id;
  if (shm_chunk_bytes < 4096 || shm_chunk_bytes % 64 != 0) {
    throw std::invalid_argument("shm_chunk_bytes must be a multiple of 64, at least 4096");
  }
  options.shm.chunk_bytes = shm_chunk_bytes;
  options.shm.spin_us = shm_spin_us;
  options.shm.copy = parse_shm_copy(shm_copy);

  StorePtr base;
  std::shared_ptr<PythonStore> python_store;
  if (!store_client.is_none()) {
    python_store = std::make_shared<PythonStore>(store_client, options.timeout);
    base = python_store;
  } else {
    base = std::make_shared<gloo::rendezvous::FileStore>(file_store);
  }
  StorePtr store = make_prefix_store(prefix, std::move(base));
  std::unique_ptr<Communicator> comm;
  try {
    nb::gil_scoped_release release;
    comm = std::make_unique<Communicator>(options, store);
  } catch (...) {
    if (python_store) python_store->close();
    throw;
  }
  if (python_store) python_store->close();
  return std::make_unique<PyCommunicator>(std::move(comm));
}

// The native hand-off's table in a capsule named TNT_NATIVE_COMM_CAPSULE that owns it
// (and through it the communicator's shared state); `plan`: GlooSettings.algorithm_plan.
nb::capsule native_comm(PyCommunicator& comm,
                        const std::vector<std::pair<std::uint64_t, std::string>>& plan) {
  std::vector<AlgorithmStep> steps;
  steps.reserve(plan.size());
  for (const auto& [max_bytes, algorithm] : plan) {
    steps.push_back(AlgorithmStep{max_bytes, parse_algorithm(algorithm)});
  }
  tnt_native_comm* table = make_native_comm(comm.comm(), std::move(steps));
  try {
    return nb::capsule(table, TNT_NATIVE_COMM_CAPSULE,
                       [](void* p) noexcept { free_native_comm(p); });
  } catch (...) {
    free_native_comm(table);
    throw;
  }
}

bool wait_on(PyCommunicator& comm, std::shared_ptr<Work> work, double timeout_s) {
  bool done;
  {
    nb::gil_scoped_release release;
    done = comm.comm().wait(work,
                            std::chrono::duration<double>(timeout_s > 0 ? timeout_s : 0.0));
  }
  if (done) {
    std::string error = work->error();
    if (!error.empty()) throw GlooError(error);
  }
  return done;
}

}  // namespace
}  // namespace tnt_gloo

NB_MODULE(_gloo, m) {
  using namespace tnt_gloo;
  m.doc() = "Private native layer of tnt_comm_gloo: Gloo collectives on a worker thread, "
            "sends and receives beside it.";

  // A communicator still referenced when the interpreter exits (a script's uncaught
  // exception keeps its frames, and through them the backend, alive past this module's
  // teardown) is freed with the process; nanobind's leak report would read to the user as a
  // bug of the script's failure, above the script's own traceback.
  nb::set_leak_warnings(false);

  nb::exception<GlooError>(m, "GlooError");

  nb::class_<Work>(m, "Work", "An operation queued on the worker thread.")
      .def("done", &Work::done, "True once the operation has finished, successfully or not.")
      .def("completion_time", &Work::completion_time,
           "time.perf_counter() seconds at completion, or -1 while not done.")
      .def_prop_ro("name", &Work::name);

  nb::class_<PyCommunicator>(m, "Communicator", "A full-mesh TCP Gloo context.")
      .def_prop_ro("rank", [](PyCommunicator& c) { return c.comm().rank(); })
      .def_prop_ro("size", [](PyCommunicator& c) { return c.comm().size(); })
      .def_prop_ro("failure", [](PyCommunicator& c) { return c.comm().failure(); })
      .def_prop_ro("allreduce_transport",
                   [](PyCommunicator& c) { return std::string(c.comm().allreduce_transport()); })
      .def_prop_ro("shm_reason", [](PyCommunicator& c) { return c.comm().shm_reason(); })
      .def_prop_ro("shm_segment_name",
                   [](PyCommunicator& c) { return c.comm().shm_segment_name(); })
      .def_prop_ro("shm_copy", [](PyCommunicator& c) { return c.comm().shm_copy(); },
                   "How this rank copies into its shared-memory slots: 'stream' "
                   "(non-temporal stores), 'cache' (memcpy), 'auto' while it still times "
                   "both; '' without shared memory.")
      .def("p2p_transport", [](PyCommunicator& c, int peer) { return c.comm().p2p_transport(peer); },
           "peer"_a,
           "What messages to and from `peer` go over: 'shm' (a ring in shared memory: the "
           "peer is on this host), 'self' or 'tcp'.")
      .def_prop_ro("host_layout", [](PyCommunicator& c) { return c.comm().host_layout(); },
                   "(hosts, ranks per host) of the hierarchical allreduce; (1, size) "
                   "without it.")
      .def("allreduce", &PyCommunicator::allreduce, "buf"_a.noconvert(), "op"_a,
           "algorithm"_a, "name"_a, "Queue an in-place allreduce of a host array.")
      .def("allreduce_dlpack", &PyCommunicator::allreduce_dlpack, "capsule"_a, "op"_a,
           "algorithm"_a, "name"_a,
           "Queue an in-place allreduce of a DLPack tensor (CUDA: staged through pinned "
           "host memory).")
      .def("broadcast", &PyCommunicator::broadcast, "buf"_a.noconvert(), "root"_a, "name"_a,
           "Queue an in-place broadcast from root.")
      .def("allgather", &PyCommunicator::allgather, "src"_a.noconvert(), "dst"_a.noconvert(),
           "name"_a, "Queue gathering every rank's src into dst (size * src bytes).")
      .def("barrier", &PyCommunicator::barrier, "name"_a, "Queue a barrier.")
      .def("send", &PyCommunicator::send, "buf"_a.noconvert(), "dest"_a, "tag"_a, "name"_a,
           "Start sending buf to rank dest (not queued behind collectives); the bytes are "
           "read until the Work is done.")
      .def("recv", &PyCommunicator::recv, "buf"_a.noconvert(), "src"_a, "tag"_a, "name"_a,
           "Start receiving the next message from rank src with tag into buf; a message "
           "of another byte size fails the Work.")
      .def("wait", &wait_on, "work"_a, "timeout_s"_a,
           "Block (GIL released) up to timeout_s for work; True once done, False if still "
           "running. Raises GlooError if it failed. If work is next in line and the worker "
           "idle, runs it on this thread.")
      .def("time_direct_allreduce", &PyCommunicator::time_direct_allreduce,
           "buf"_a.noconvert(), "algorithm"_a, "iters"_a,
           "Benchmark baseline: the allreduce algorithm (sum; ring, bcube, doubling over "
           "TCP, or shm) called directly iters times on this thread, bypassing the queue; "
           "seconds per call.")
      .def("native_comm", &native_comm, "plan"_a,
           "The native hand-off: a capsule named 'tnt_native_comm' holding the C table of "
           "tnt_native_comm.h, whose allreduce_async queues behind this communicator's "
           "collectives; plan is [(max_bytes, algorithm), ...] (the first step a buffer "
           "fits in, else the last). The table refuses once the communicator is closed.")
      .def("abort", [](PyCommunicator& c, const std::string& reason) { c.comm().abort(reason); },
           "reason"_a, "Fail this and every later operation; close the connections.")
      .def("close",
           [](PyCommunicator& c, double grace_s) {
             nb::gil_scoped_release release;
             return c.comm().close(std::chrono::milliseconds(
                 static_cast<long long>(grace_s > 0 ? grace_s * 1000.0 : 0.0)));
           },
           "grace_s"_a,
           "Finish queued operations (up to grace_s), stop the worker, close connections. "
           "False if the worker had to be abandoned.");

  m.def("dlpack_nbytes",
        [](nb::handle capsule) {
          const DeviceTensor t = parse_capsule(capsule);
          return t.count * element_size(t.dtype);
        },
        "capsule"_a, "Bytes of the tensor in an unconsumed DLPack capsule (checks it too).");

  m.def("connect", &connect, "rank"_a, "size"_a, "store"_a.none(), "file_store"_a,
        "prefix"_a, "hostname"_a, "iface"_a, "timeout_s"_a, "shm"_a = "auto",
        "shm_prefix"_a = "tnt-gloo-", "shm_host_id"_a = "", "shm_chunk_bytes"_a = 256 << 10,
        "shm_spin_us"_a = -1, "hierarchy"_a = "auto", "shm_copy"_a = "auto",
        "Build the full TCP mesh (blocking, GIL released) through the store client or the "
        "file store directory; then, collectively, the shared-memory allreduce when every "
        "rank is on this host (shm: 'auto', '0' off, '1' try even so; the caller decides "
        "what a failure means), or the hierarchical one when the ranks are on several "
        "hosts holding as many (>= 2) each (hierarchy: 'auto', '0' off, '1' as auto). "
        "shm_copy: how a rank copies into its slots ('stream', 'cache', or 'auto': the "
        "faster of the two on its first large copies).");
}
