// tarantella's TensorFlow ops, on TensorFlow's stable C API only (tensorflow/c/kernels.h,
// tensorflow/c/ops.h): one binary loads into every TensorFlow 2 release that has that API,
// with no C++ ABI shared with TensorFlow (Horovod's TF ops compile against each release's
// C++ headers and break with them).
//
//   TntPushBucket    hands one bucket's gradients, scaled by the rank's factor, to its
//                    allreduce, started when it is next in line (copied into the bucket
//                    first, unless the backend gathers them itself: ABI 3); returns at
//                    once (a token for the finish to wait on).
//   TntFinishReduce  waits for every bucket of the step and outputs the reduced gradients
//                    as tensors that wrap the buckets (no copy back).
//   TntSend          starts sending a tensor to a peer (point-to-point, ABI 2 of the
//                    table); returns a token at once and keeps the tensor until it is sent.
//   TntRecv          receives the next message from a peer with a tag, as a tensor of the
//                    given dtype and shape wrapping the receive buffer (no copy).
//   TntWaitSends     waits for the sends of the given tokens (outputs their number).
//
// The finish and TntRecv block the TensorFlow thread they run on while they wait. The C
// API's asynchronous kernels cannot avoid that: TensorFlow passes the kernel a pointer to its
// `done` callback's copy on the ComputeAsync stack frame (CAsyncOpKernel::ComputeAsync in
// tensorflow/c/kernels.cc), so calling it after the kernel returned is a use after free
// (measured: a segfault inside tf.function). The numpy_function path blocks a thread the
// same way; what the ops remove is Python, the GIL and the copies around the collective.
//
// The reducers (reducer.h) and the point-to-point channels (channel.h) are made and freed
// from Python through the C functions at the end of this file (ctypes); a kernel names its
// reducer or channel by the id in its attrs.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tensorflow/c/kernels.h"
#include "tensorflow/c/ops.h"
#include "tensorflow/c/tf_datatype.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"

#include "channel.h"
#include "reducer.h"

namespace tnt_keras {
namespace {

std::mutex registry_mu;
std::unordered_map<std::int64_t, std::shared_ptr<Reducer>> registry;
std::unordered_map<std::int64_t, std::shared_ptr<Channel>> channels;
std::int64_t next_id = 1;  // one numbering for reducers and channels

std::shared_ptr<Channel> find_channel(std::int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = channels.find(id);
  return it == channels.end() ? nullptr : it->second;
}

std::shared_ptr<Reducer> find_reducer(std::int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry.find(id);
  return it == registry.end() ? nullptr : it->second;
}

void fail(TF_OpKernelContext* ctx, TF_Code code, const std::string& message);

// The kernel's reducer, or null after failing the kernel with why it is gone.
std::shared_ptr<Reducer> reducer_or_fail(TF_OpKernelContext* ctx, std::int64_t id) {
  auto reducer = find_reducer(id);
  if (!reducer) {
    fail(ctx, TF_FAILED_PRECONDITION,
         "tarantella's gradient reducer " + std::to_string(id) +
             " is gone (its model or the job's backend was closed); compile the model again");
  }
  return reducer;
}

std::int32_t native_dtype(TF_DataType t) {
  switch (t) {
    case TF_HALF: return TNT_NATIVE_FLOAT16;
    case TF_FLOAT: return TNT_NATIVE_FLOAT32;
    case TF_DOUBLE: return TNT_NATIVE_FLOAT64;
    case TF_INT32: return TNT_NATIVE_INT32;
    case TF_INT64: return TNT_NATIVE_INT64;
    default: return 0;
  }
}

TF_DataType tf_dtype(std::int32_t d) {
  switch (d) {
    case TNT_NATIVE_FLOAT16: return TF_HALF;
    case TNT_NATIVE_FLOAT32: return TF_FLOAT;
    case TNT_NATIVE_FLOAT64: return TF_DOUBLE;
    case TNT_NATIVE_INT32: return TF_INT32;
    default: return TF_INT64;
  }
}

void fail(TF_OpKernelContext* ctx, TF_Code code, const std::string& message) {
  TF_Status* status = TF_NewStatus();
  TF_SetStatus(status, code, message.c_str());
  TF_OpKernelContext_Failure(ctx, status);
  TF_DeleteStatus(status);
}

// Output 0 of an op whose result is one int64 (a token or a count).
void output_int64(TF_OpKernelContext* ctx, std::int64_t value) {
  TF_Status* status = TF_NewStatus();
  TF_Tensor* out = TF_AllocateOutput(ctx, 0, TF_INT64, nullptr, 0, sizeof(std::int64_t), status);
  if (TF_GetCode(status) == TF_OK) {
    *static_cast<std::int64_t*>(TF_TensorData(out)) = value;
  } else {
    TF_OpKernelContext_Failure(ctx, status);
  }
  if (out != nullptr) TF_DeleteTensor(out);
  TF_DeleteStatus(status);
}

std::vector<std::int64_t> int_list_attr(TF_OpKernelConstruction* ctx, const char* name,
                                        TF_Status* status) {
  std::int32_t list_size = 0, total_size = 0;
  TF_OpKernelConstruction_GetAttrSize(ctx, name, &list_size, &total_size, status);
  std::vector<std::int64_t> values(list_size > 0 ? list_size : 0);
  if (TF_GetCode(status) == TF_OK && list_size > 0) {
    TF_OpKernelConstruction_GetAttrInt64List(ctx, name, values.data(), list_size, status);
  }
  return values;
}

// -- TntPushBucket ------------------------------------------------------------------------

struct PushKernel {
  std::int64_t reducer = 0;
  std::int64_t bucket = 0;
  std::vector<std::int64_t> offsets;
};

void* push_create(TF_OpKernelConstruction* ctx) {
  auto* k = new PushKernel;
  TF_Status* status = TF_NewStatus();
  TF_OpKernelConstruction_GetAttrInt64(ctx, "reducer", &k->reducer, status);
  if (TF_GetCode(status) == TF_OK) TF_OpKernelConstruction_GetAttrInt64(ctx, "bucket", &k->bucket, status);
  if (TF_GetCode(status) == TF_OK) k->offsets = int_list_attr(ctx, "offsets", status);
  if (TF_GetCode(status) != TF_OK) TF_OpKernelConstruction_Failure(ctx, status);
  TF_DeleteStatus(status);
  return k;
}

void push_delete(void* kernel) { delete static_cast<PushKernel*>(kernel); }

void push_compute(void* kernel, TF_OpKernelContext* ctx) {
  auto* k = static_cast<PushKernel*>(kernel);
  auto reducer = reducer_or_fail(ctx, k->reducer);
  if (!reducer) return;
  const int n = TF_NumInputs(ctx) - 1;  // the tensors, then the factor
  if (n != static_cast<int>(k->offsets.size())) {
    fail(ctx, TF_INVALID_ARGUMENT, "TntPushBucket: offsets and tensors differ in number");
    return;
  }
  TF_Status* status = TF_NewStatus();
  std::vector<TF_Tensor*> inputs(n + 1, nullptr);
  std::vector<const void*> srcs(n);
  std::vector<std::int64_t> counts(n);
  std::string error;
  for (int i = 0; i <= n && error.empty(); ++i) {
    TF_GetInput(ctx, i, &inputs[i], status);
    if (TF_GetCode(status) != TF_OK) error = TF_Message(status);
  }
  double factor = 1.0;
  if (error.empty()) {
    std::memcpy(&factor, TF_TensorData(inputs[n]), sizeof(double));
    const std::int32_t want = reducer->bucket(static_cast<std::size_t>(k->bucket)).dtype;
    for (int i = 0; i < n && error.empty(); ++i) {
      if (native_dtype(TF_TensorType(inputs[i])) != want) error = "TntPushBucket: dtype differs from the bucket's";
      srcs[i] = TF_TensorData(inputs[i]);
      counts[i] = TF_TensorElementCount(inputs[i]);
    }
  }
  // The gradients' tensors, released when the reducer lets go: at once when it copies
  // them into its bucket, after their allreduce when the backend gathers them itself.
  std::shared_ptr<void> keep(new std::vector<TF_Tensor*>(std::move(inputs)), [](void* p) {
    auto* tensors = static_cast<std::vector<TF_Tensor*>*>(p);
    for (TF_Tensor* t : *tensors) if (t != nullptr) TF_DeleteTensor(t);
    delete tensors;
  });
  if (error.empty()) {
    error = reducer->push(static_cast<std::size_t>(k->bucket), srcs, counts, k->offsets, factor,
                          keep);
  }
  keep.reset();
  if (!error.empty()) {
    TF_DeleteStatus(status);
    fail(ctx, TF_ABORTED, error);
    return;
  }
  TF_DeleteStatus(status);
  output_int64(ctx, k->bucket);
}

// -- TntFinishReduce ----------------------------------------------------------------------

struct FinishKernel {
  std::int64_t reducer = 0;
  std::vector<std::int64_t> buckets, offsets, ranks, dims;
};

void* finish_create(TF_OpKernelConstruction* ctx) {
  auto* k = new FinishKernel;
  TF_Status* status = TF_NewStatus();
  TF_OpKernelConstruction_GetAttrInt64(ctx, "reducer", &k->reducer, status);
  if (TF_GetCode(status) == TF_OK) k->buckets = int_list_attr(ctx, "buckets", status);
  if (TF_GetCode(status) == TF_OK) k->offsets = int_list_attr(ctx, "offsets", status);
  if (TF_GetCode(status) == TF_OK) k->ranks = int_list_attr(ctx, "ranks", status);
  if (TF_GetCode(status) == TF_OK) k->dims = int_list_attr(ctx, "dims", status);
  if (TF_GetCode(status) != TF_OK) TF_OpKernelConstruction_Failure(ctx, status);
  TF_DeleteStatus(status);
  return k;
}

void finish_delete(void* kernel) { delete static_cast<FinishKernel*>(kernel); }

void release_buffer(void* /*data*/, size_t /*len*/, void* arg) {
  delete static_cast<std::shared_ptr<Buffer>*>(arg);
}

void finish_compute(void* kernel, TF_OpKernelContext* ctx) {
  auto* k = static_cast<FinishKernel*>(kernel);
  auto reducer = reducer_or_fail(ctx, k->reducer);
  if (!reducer) return;
  std::vector<std::shared_ptr<Buffer>> buffers;
  const std::string error = reducer->finish(&buffers);
  if (!error.empty()) {
    fail(ctx, TF_ABORTED, error);
    return;
  }
  TF_Status* status = TF_NewStatus();
  std::size_t dim = 0;
  for (std::size_t i = 0; i < k->buckets.size(); ++i) {
    const auto b = static_cast<std::size_t>(k->buckets[i]);
    const BucketSpec& spec = reducer->bucket(b);
    const TF_DataType dtype = tf_dtype(spec.dtype);
    std::int64_t count = 1;
    std::vector<std::int64_t> shape(k->dims.begin() + static_cast<std::ptrdiff_t>(dim),
                                    k->dims.begin() + static_cast<std::ptrdiff_t>(dim + k->ranks[i]));
    dim += static_cast<std::size_t>(k->ranks[i]);
    for (auto d : shape) count *= d;
    const std::size_t bytes = static_cast<std::size_t>(count) * TF_DataTypeSize(dtype);
    char* data = buffers[b]->data() + static_cast<std::size_t>(k->offsets[i]) * TF_DataTypeSize(dtype);
    // the tensor keeps the bucket alive; the next push writes elsewhere while it lives
    TF_Tensor* t = TF_NewTensor(dtype, shape.data(), static_cast<int>(shape.size()), data, bytes,
                                &release_buffer, new std::shared_ptr<Buffer>(buffers[b]));
    TF_SetOutput(ctx, static_cast<int>(i), t, status);
    TF_DeleteTensor(t);
    if (TF_GetCode(status) != TF_OK) {
      TF_OpKernelContext_Failure(ctx, status);
      break;
    }
  }
  TF_DeleteStatus(status);
}

// -- TntSend, TntRecv, TntWaitSends ---------------------------------------------------------

struct P2pKernel {
  std::int64_t channel = 0;
  std::int64_t peer = 0;
  std::int64_t tag = 0;
  TF_DataType dtype = TF_FLOAT;     // TntRecv
  std::vector<std::int64_t> shape;  // TntRecv
};

// The kernel's channel, or null after failing the kernel with why it is gone.
std::shared_ptr<Channel> channel_or_fail(TF_OpKernelContext* ctx, std::int64_t id) {
  auto channel = find_channel(id);
  if (!channel) {
    fail(ctx, TF_FAILED_PRECONDITION,
         "tarantella's point-to-point channel " + std::to_string(id) +
             " is gone (its backend was closed); trace the function again");
  }
  return channel;
}

void* p2p_create(TF_OpKernelConstruction* ctx) {
  auto* k = new P2pKernel;
  TF_Status* status = TF_NewStatus();
  TF_OpKernelConstruction_GetAttrInt64(ctx, "channel", &k->channel, status);
  if (TF_GetCode(status) == TF_OK) TF_OpKernelConstruction_GetAttrInt64(ctx, "peer", &k->peer, status);
  if (TF_GetCode(status) == TF_OK) TF_OpKernelConstruction_GetAttrInt64(ctx, "tag", &k->tag, status);
  if (TF_GetCode(status) != TF_OK) TF_OpKernelConstruction_Failure(ctx, status);
  TF_DeleteStatus(status);
  return k;
}

void* recv_create(TF_OpKernelConstruction* ctx) {
  auto* k = static_cast<P2pKernel*>(p2p_create(ctx));
  TF_Status* status = TF_NewStatus();
  TF_OpKernelConstruction_GetAttrType(ctx, "dtype", &k->dtype, status);
  if (TF_GetCode(status) == TF_OK) k->shape = int_list_attr(ctx, "shape", status);
  if (TF_GetCode(status) != TF_OK) TF_OpKernelConstruction_Failure(ctx, status);
  TF_DeleteStatus(status);
  return k;
}

void p2p_delete(void* kernel) { delete static_cast<P2pKernel*>(kernel); }

void send_compute(void* kernel, TF_OpKernelContext* ctx) {
  auto* k = static_cast<P2pKernel*>(kernel);
  auto channel = channel_or_fail(ctx, k->channel);
  if (!channel) return;
  TF_Status* status = TF_NewStatus();
  TF_Tensor* input = nullptr;
  TF_GetInput(ctx, 0, &input, status);
  if (TF_GetCode(status) != TF_OK) {
    TF_OpKernelContext_Failure(ctx, status);
    TF_DeleteStatus(status);
    return;
  }
  std::int64_t token = 0;
  // the input (a reference to the tensor's buffer) lives until the backend has sent it
  const std::string error = channel->send(
      TF_TensorData(input), static_cast<std::int64_t>(TF_TensorByteSize(input)),
      static_cast<std::int32_t>(k->peer), k->tag, [input] { TF_DeleteTensor(input); }, &token);
  if (!error.empty()) {
    TF_DeleteStatus(status);
    fail(ctx, TF_ABORTED, error);
    return;
  }
  TF_DeleteStatus(status);
  output_int64(ctx, token);
}

void recv_compute(void* kernel, TF_OpKernelContext* ctx) {
  auto* k = static_cast<P2pKernel*>(kernel);
  auto channel = channel_or_fail(ctx, k->channel);
  if (!channel) return;
  std::int64_t count = 1;
  for (auto d : k->shape) count *= d;
  const std::size_t bytes = static_cast<std::size_t>(count) * TF_DataTypeSize(k->dtype);
  std::shared_ptr<Buffer> buffer;
  try {
    buffer = std::make_shared<Buffer>(bytes, /*zeroed=*/false);
  } catch (const std::bad_alloc&) {
    fail(ctx, TF_RESOURCE_EXHAUSTED, "TntRecv: out of memory for " + std::to_string(bytes) + " bytes");
    return;
  }
  const std::string error = channel->recv(buffer, static_cast<std::int32_t>(k->peer), k->tag);
  if (!error.empty()) {
    fail(ctx, TF_ABORTED, error);
    return;
  }
  TF_Status* status = TF_NewStatus();
  // the tensor keeps the receive buffer alive
  TF_Tensor* t = TF_NewTensor(k->dtype, k->shape.data(), static_cast<int>(k->shape.size()),
                              buffer->data(), bytes, &release_buffer,
                              new std::shared_ptr<Buffer>(buffer));
  TF_SetOutput(ctx, 0, t, status);
  TF_DeleteTensor(t);
  if (TF_GetCode(status) != TF_OK) TF_OpKernelContext_Failure(ctx, status);
  TF_DeleteStatus(status);
}

void* wait_create(TF_OpKernelConstruction* ctx) {
  auto* k = new P2pKernel;
  TF_Status* status = TF_NewStatus();
  TF_OpKernelConstruction_GetAttrInt64(ctx, "channel", &k->channel, status);
  if (TF_GetCode(status) != TF_OK) TF_OpKernelConstruction_Failure(ctx, status);
  TF_DeleteStatus(status);
  return k;
}

void wait_compute(void* kernel, TF_OpKernelContext* ctx) {
  auto* k = static_cast<P2pKernel*>(kernel);
  auto channel = channel_or_fail(ctx, k->channel);
  if (!channel) return;
  TF_Status* status = TF_NewStatus();
  std::vector<std::int64_t> tokens;
  const int n = TF_NumInputs(ctx);
  for (int i = 0; i < n; ++i) {
    TF_Tensor* t = nullptr;
    TF_GetInput(ctx, i, &t, status);
    if (TF_GetCode(status) != TF_OK) {
      TF_OpKernelContext_Failure(ctx, status);
      TF_DeleteStatus(status);
      return;
    }
    const auto* values = static_cast<const std::int64_t*>(TF_TensorData(t));
    tokens.insert(tokens.end(), values, values + TF_TensorElementCount(t));
    TF_DeleteTensor(t);
  }
  const std::string error = channel->wait_sends(tokens);
  if (!error.empty()) {
    TF_DeleteStatus(status);
    fail(ctx, TF_ABORTED, error);
    return;
  }
  TF_DeleteStatus(status);
  output_int64(ctx, static_cast<std::int64_t>(tokens.size()));
}

// -- registration ---------------------------------------------------------------------------

void scalar_shape(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  TF_ShapeHandle* scalar = TF_ShapeInferenceContextScalar(ctx);
  TF_ShapeInferenceContextSetOutput(ctx, 0, scalar, status);
  TF_DeleteShapeHandle(scalar);
}

void check(TF_Status* status, const char* what) {
  if (TF_GetCode(status) != TF_OK) {
    std::fprintf(stderr, "tarantella: registering %s failed: %s\n", what, TF_Message(status));
  }
}

__attribute__((constructor)) void register_ops() {
  TF_Status* status = TF_NewStatus();
  const char* types = "{half, float, double, int32, int64}";

  TF_OpDefinitionBuilder* push = TF_NewOpDefinitionBuilder("TntPushBucket");
  TF_OpDefinitionBuilderAddInput(push, "tensors: N * T");
  TF_OpDefinitionBuilderAddInput(push, "factor: double");
  TF_OpDefinitionBuilderAddOutput(push, "token: int64");
  TF_OpDefinitionBuilderAddAttr(push, "N: int >= 1");
  TF_OpDefinitionBuilderAddAttr(push, (std::string("T: ") + types).c_str());
  TF_OpDefinitionBuilderAddAttr(push, "reducer: int");
  TF_OpDefinitionBuilderAddAttr(push, "bucket: int");
  TF_OpDefinitionBuilderAddAttr(push, "offsets: list(int)");
  TF_OpDefinitionBuilderSetIsStateful(push, true);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(push, &scalar_shape);
  TF_RegisterOpDefinition(push, status);
  check(status, "TntPushBucket");

  TF_OpDefinitionBuilder* finish = TF_NewOpDefinitionBuilder("TntFinishReduce");
  TF_OpDefinitionBuilderAddInput(finish, "tokens: M * int64");
  TF_OpDefinitionBuilderAddOutput(finish, "reduced: out_types");
  TF_OpDefinitionBuilderAddAttr(finish, "M: int >= 1");
  TF_OpDefinitionBuilderAddAttr(finish, (std::string("out_types: list(") + types + ")").c_str());
  TF_OpDefinitionBuilderAddAttr(finish, "reducer: int");
  TF_OpDefinitionBuilderAddAttr(finish, "buckets: list(int)");
  TF_OpDefinitionBuilderAddAttr(finish, "offsets: list(int)");
  TF_OpDefinitionBuilderAddAttr(finish, "ranks: list(int)");
  TF_OpDefinitionBuilderAddAttr(finish, "dims: list(int)");
  TF_OpDefinitionBuilderSetIsStateful(finish, true);
  TF_RegisterOpDefinition(finish, status);
  check(status, "TntFinishReduce");

  // point-to-point moves bytes: any fixed-size type
  const char* p2p_types = "{half, bfloat16, float, double, int8, uint8, int16, uint16, int32, "
                          "uint32, int64, uint64, bool, complex64, complex128}";
  TF_OpDefinitionBuilder* send = TF_NewOpDefinitionBuilder("TntSend");
  TF_OpDefinitionBuilderAddInput(send, "tensor: T");
  TF_OpDefinitionBuilderAddOutput(send, "token: int64");
  TF_OpDefinitionBuilderAddAttr(send, (std::string("T: ") + p2p_types).c_str());
  TF_OpDefinitionBuilderAddAttr(send, "channel: int");
  TF_OpDefinitionBuilderAddAttr(send, "peer: int");
  TF_OpDefinitionBuilderAddAttr(send, "tag: int");
  TF_OpDefinitionBuilderSetIsStateful(send, true);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(send, &scalar_shape);
  TF_RegisterOpDefinition(send, status);
  check(status, "TntSend");

  TF_OpDefinitionBuilder* recv = TF_NewOpDefinitionBuilder("TntRecv");
  TF_OpDefinitionBuilderAddOutput(recv, "tensor: dtype");
  TF_OpDefinitionBuilderAddAttr(recv, (std::string("dtype: ") + p2p_types).c_str());
  TF_OpDefinitionBuilderAddAttr(recv, "shape: list(int)");
  TF_OpDefinitionBuilderAddAttr(recv, "channel: int");
  TF_OpDefinitionBuilderAddAttr(recv, "peer: int");
  TF_OpDefinitionBuilderAddAttr(recv, "tag: int");
  TF_OpDefinitionBuilderSetIsStateful(recv, true);
  TF_RegisterOpDefinition(recv, status);
  check(status, "TntRecv");

  TF_OpDefinitionBuilder* wait = TF_NewOpDefinitionBuilder("TntWaitSends");
  TF_OpDefinitionBuilderAddInput(wait, "tokens: N * int64");
  TF_OpDefinitionBuilderAddOutput(wait, "count: int64");
  TF_OpDefinitionBuilderAddAttr(wait, "N: int >= 1");
  TF_OpDefinitionBuilderAddAttr(wait, "channel: int");
  TF_OpDefinitionBuilderSetIsStateful(wait, true);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(wait, &scalar_shape);
  TF_RegisterOpDefinition(wait, status);
  check(status, "TntWaitSends");

  struct {
    const char* name;
    void* (*create)(TF_OpKernelConstruction*);
    void (*compute)(void*, TF_OpKernelContext*);
  } p2p_kernels[] = {{"TntSend", &p2p_create, &send_compute},
                     {"TntRecv", &recv_create, &recv_compute},
                     {"TntWaitSends", &wait_create, &wait_compute}};
  for (const auto& kernel : p2p_kernels) {
    TF_KernelBuilder* builder =
        TF_NewKernelBuilder(kernel.name, "CPU", kernel.create, kernel.compute, &p2p_delete);
    TF_RegisterKernelBuilder(kernel.name, builder, status);
    check(status, kernel.name);
  }

  TF_KernelBuilder* push_kernel =
      TF_NewKernelBuilder("TntPushBucket", "CPU", &push_create, &push_compute, &push_delete);
  TF_RegisterKernelBuilder("TntPushBucket", push_kernel, status);
  check(status, "the TntPushBucket kernel");
  TF_KernelBuilder* finish_kernel =
      TF_NewKernelBuilder("TntFinishReduce", "CPU", &finish_create, &finish_compute, &finish_delete);
  TF_RegisterKernelBuilder("TntFinishReduce", finish_kernel, status);
  check(status, "the TntFinishReduce kernel");
  TF_DeleteStatus(status);
}

}  // namespace
}  // namespace tnt_keras

// -- the reducers, from Python (ctypes) -------------------------------------------------------

extern "C" {

// A reducer over `comm` (a backend's checked native table) for `n` buckets, numbering its
// allreduces in `ledger` (the job's stall ledger, or null); its id (> 0), or 0 with the
// reason in err.
__attribute__((visibility("default"))) std::int64_t tnt_reducer_create(
    const tnt_native_comm* comm, tnt_stall_ledger* ledger, std::int32_t n, const std::int32_t* dtypes,
    const std::int64_t* sizes, std::int32_t op, std::int32_t overlap, double timeout_s,
    std::int32_t (*agree)(void*, char*, std::int64_t),
    void (*failed)(void*, const char*, char*, std::int64_t), void* hook_arg, char* err,
    std::int64_t errlen) {
  using namespace tnt_keras;
  try {
    if (ledger != nullptr && (ledger->abi_version != TNT_STALL_LEDGER_ABI_VERSION ||
                              ledger->struct_size < sizeof(tnt_stall_ledger))) {
      std::snprintf(err, static_cast<std::size_t>(errlen),
                    "tnt-core's stall ledger is ABI %u (%u bytes); this op library was built "
                    "for ABI %d (%zu bytes): reinstall tnt-keras against the installed tnt-core",
                    ledger->abi_version, ledger->struct_size, TNT_STALL_LEDGER_ABI_VERSION,
                    sizeof(tnt_stall_ledger));
      return 0;
    }
    std::vector<BucketSpec> buckets;
    for (std::int32_t i = 0; i < n; ++i) buckets.push_back(BucketSpec{dtypes[i], sizes[i]});
    PythonHooks hooks;
    hooks.agree = agree;
    hooks.failed = failed;
    hooks.arg = hook_arg;
    auto reducer = std::make_shared<Reducer>(comm, ledger, std::move(buckets), op, overlap != 0, timeout_s, hooks);
    std::lock_guard<std::mutex> lock(registry_mu);
    const std::int64_t id = next_id++;
    registry.emplace(id, std::move(reducer));
    return id;
  } catch (const std::exception& e) {
    std::snprintf(err, static_cast<std::size_t>(errlen), "%s", e.what());
    return 0;
  }
}

// A point-to-point channel over `comm` (a backend's checked native table); its id (> 0), or
// 0 with the reason in err (a table without point-to-point: ABI 1).
__attribute__((visibility("default"))) std::int64_t tnt_channel_create(
    const tnt_native_comm* comm, double timeout_s,
    void (*failed)(void*, const char*, char*, std::int64_t), void* hook_arg, char* err,
    std::int64_t errlen) {
  using namespace tnt_keras;
  try {
    if (comm == nullptr || !tnt_native_comm_has_p2p(comm)) {
      std::snprintf(err, static_cast<std::size_t>(errlen),
                    "the backend's native table is ABI %u (%u bytes): it has no point-to-point "
                    "(ABI %d)", comm ? comm->abi_version : 0u, comm ? comm->struct_size : 0u,
                    TNT_NATIVE_COMM_ABI_P2P);
      return 0;
    }
    PythonHooks hooks;
    hooks.failed = failed;
    hooks.arg = hook_arg;
    auto channel = std::make_shared<Channel>(comm, timeout_s, hooks);
    std::lock_guard<std::mutex> lock(registry_mu);
    const std::int64_t id = next_id++;
    channels.emplace(id, std::move(channel));
    return id;
  } catch (const std::exception& e) {
    std::snprintf(err, static_cast<std::size_t>(errlen), "%s", e.what());
    return 0;
  }
}

// Forget a channel; kernels that still name it fail with a message. In-flight sends and
// receives keep it alive until they complete.
__attribute__((visibility("default"))) void tnt_channel_destroy(std::int64_t id) {
  std::lock_guard<std::mutex> lock(tnt_keras::registry_mu);
  tnt_keras::channels.erase(id);
}

// Seconds the channel's receives have spent blocked (0 for an unknown id).
__attribute__((visibility("default"))) double tnt_channel_waited(std::int64_t id) {
  std::lock_guard<std::mutex> lock(tnt_keras::registry_mu);
  const auto found = tnt_keras::channels.find(id);
  return found == tnt_keras::channels.end() ? 0.0 : found->second->waited_s();
}

// Forget a reducer; kernels that still name it fail with a message. In-flight allreduces
// keep it alive until they complete.
__attribute__((visibility("default"))) void tnt_reducer_destroy(std::int64_t id) {
  std::lock_guard<std::mutex> lock(tnt_keras::registry_mu);
  tnt_keras::registry.erase(id);
}

// The last finished step's times (3 per bucket: pushed, issued, done) into out; their number.
__attribute__((visibility("default"))) std::int32_t tnt_reducer_times(std::int64_t id, double* out,
                                                                      std::int32_t capacity) {
  auto reducer = tnt_keras::find_reducer(id);
  if (!reducer) return 0;
  const auto times = reducer->last_times();
  const auto n = std::min<std::size_t>(times.size(), static_cast<std::size_t>(capacity));
  std::copy(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(n), out);
  return static_cast<std::int32_t>(n);
}

}  // extern "C"
