// GPU buffers through pinned host memory, with no build-time CUDA dependency.
//
// The system Gloo (Debian's libgloo-dev) is built without CUDA, so device buffers are
// copied to a pinned host buffer, reduced by the CPU algorithms and copied back. The CUDA
// runtime is loaded with dlopen on first use (TNT_GLOO_CUDART names the library; default
// libcudart.so, libcudart.so.12, libcudart.so.11.0).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace tnt_gloo {

// The DLPack ABI (dlpack.h, v0.8 layout, unversioned "dltensor" capsules).
namespace dlpack {
enum DeviceType : std::int32_t {
  kCPU = 1,
  kCUDA = 2,
  kCUDAHost = 3,
  kCUDAManaged = 13,
};
enum TypeCode : std::uint8_t { kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4 };
struct Device {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  std::int32_t ndim;
  DataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};
}  // namespace dlpack

// The few CUDA runtime entry points staging needs, resolved with dlopen.
class CudaRuntime {
 public:
  // The process-wide runtime; throws GlooError saying what to install if it cannot load.
  static CudaRuntime& get();

  void set_device(int device);
  // Wait for the current device's legacy default stream (which DLPack's stream=1 made
  // the producer's work run before).
  void synchronize();
  void copy_to_host(void* host, const void* device, std::size_t nbytes);
  void copy_to_device(void* device, const void* host, std::size_t nbytes);
  void* alloc_pinned(std::size_t nbytes);
  void free_pinned(void* ptr) noexcept;
  const std::string& library() const { return library_; }

 private:
  CudaRuntime();
  void check(int status, const char* what) const;

  std::string library_;
  int (*set_device_)(int) = nullptr;
  int (*stream_synchronize_)(void*) = nullptr;
  int (*malloc_host_)(void**, std::size_t) = nullptr;
  int (*free_host_)(void*) = nullptr;
  int (*memcpy_)(void*, const void*, std::size_t, int) = nullptr;
  const char* (*error_string_)(int) = nullptr;
};

// A grow-only pinned host buffer, used by one worker thread at a time.
class StagingBuffer {
 public:
  StagingBuffer() = default;
  ~StagingBuffer();
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  void* reserve(std::size_t nbytes);

 private:
  void* data_ = nullptr;
  std::size_t capacity_ = 0;
};

}  // namespace tnt_gloo
