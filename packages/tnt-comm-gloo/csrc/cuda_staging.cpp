#include "cuda_staging.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "errors.h"

namespace tnt_gloo {
namespace {

constexpr int kMemcpyHostToDevice = 1;  // cudaMemcpyKind values
constexpr int kMemcpyDeviceToHost = 2;

template <typename Fn>
Fn resolve(void* handle, const char* name, const std::string& library) {
  void* sym = dlsym(handle, name);
  if (sym == nullptr) {
    throw GlooError(library + " has no symbol " + name + "; it is not a CUDA runtime");
  }
  return reinterpret_cast<Fn>(sym);
}

}  // namespace

CudaRuntime::CudaRuntime() {
  std::vector<std::string> candidates;
  const char* override_name = std::getenv("TNT_GLOO_CUDART");
  if (override_name != nullptr && override_name[0] != '\0') {
    candidates.emplace_back(override_name);
  } else {
    candidates = {"libcudart.so", "libcudart.so.12", "libcudart.so.11.0"};
  }
  void* handle = nullptr;
  std::string tried;
  for (const auto& name : candidates) {
    handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) {
      library_ = name;
      break;
    }
    const char* why = dlerror();
    tried += "\n  " + name + ": " + (why ? why : "not found");
  }
  if (handle == nullptr) {
    throw GlooError(
        "a GPU buffer needs the CUDA runtime for staging through host memory, but it "
        "could not be loaded:" + tried +
        "\nInstall the CUDA runtime (e.g. pip install nvidia-cuda-runtime-cu12 and add "
        "its lib directory to LD_LIBRARY_PATH) or set TNT_GLOO_CUDART to libcudart's path");
  }
  // The handle is never closed: the runtime lives as long as the process.
  set_device_ = resolve<int (*)(int)>(handle, "cudaSetDevice", library_);
  stream_synchronize_ = resolve<int (*)(void*)>(handle, "cudaStreamSynchronize", library_);
  malloc_host_ = resolve<int (*)(void**, std::size_t)>(handle, "cudaMallocHost", library_);
  free_host_ = resolve<int (*)(void*)>(handle, "cudaFreeHost", library_);
  memcpy_ = resolve<int (*)(void*, const void*, std::size_t, int)>(handle, "cudaMemcpy",
                                                                    library_);
  error_string_ = resolve<const char* (*)(int)>(handle, "cudaGetErrorString", library_);
}

CudaRuntime& CudaRuntime::get() {
  // Loading is retried on the next call if it failed (e.g. LD_LIBRARY_PATH fixed later
  // cannot help a running process, but TNT_GLOO_CUDART can be set before the next try).
  static std::mutex mu;
  static std::unique_ptr<CudaRuntime> runtime;
  std::lock_guard<std::mutex> lock(mu);
  if (!runtime) runtime.reset(new CudaRuntime());
  return *runtime;
}

void CudaRuntime::check(int status, const char* what) const {
  if (status != 0) {
    const char* text = error_string_ ? error_string_(status) : nullptr;
    throw GlooError(std::string("CUDA ") + what + " failed: " +
                    (text ? text : "error " + std::to_string(status)));
  }
}

void CudaRuntime::set_device(int device) { check(set_device_(device), "cudaSetDevice"); }

void CudaRuntime::synchronize() {
  check(stream_synchronize_(nullptr), "cudaStreamSynchronize");  // 0: the legacy stream
}

void CudaRuntime::copy_to_host(void* host, const void* device, std::size_t nbytes) {
  check(memcpy_(host, device, nbytes, kMemcpyDeviceToHost), "cudaMemcpy device->host");
}

void CudaRuntime::copy_to_device(void* device, const void* host, std::size_t nbytes) {
  check(memcpy_(device, host, nbytes, kMemcpyHostToDevice), "cudaMemcpy host->device");
}

void* CudaRuntime::alloc_pinned(std::size_t nbytes) {
  void* ptr = nullptr;
  check(malloc_host_(&ptr, nbytes), "cudaMallocHost");
  return ptr;
}

void CudaRuntime::free_pinned(void* ptr) noexcept {
  if (ptr != nullptr) free_host_(ptr);
}

StagingBuffer::~StagingBuffer() {
  if (data_ != nullptr) CudaRuntime::get().free_pinned(data_);
}

void* StagingBuffer::reserve(std::size_t nbytes) {
  if (nbytes > capacity_) {
    auto& cuda = CudaRuntime::get();
    cuda.free_pinned(data_);
    data_ = nullptr;
    capacity_ = 0;
    // Round up to 1 MiB so that a growing series of buckets does not reallocate each time.
    const std::size_t rounded = (nbytes + (1u << 20) - 1) & ~((std::size_t{1} << 20) - 1);
    data_ = cuda.alloc_pinned(rounded);
    capacity_ = rounded;
  }
  return data_;
}

}  // namespace tnt_gloo
