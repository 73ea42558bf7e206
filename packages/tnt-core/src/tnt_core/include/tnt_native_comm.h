/* tnt_native_comm.h: the native hand-off of the CommBackend contract (optional), ABI 1.
 *
 * Why: a framework's compiled ops (tnt-keras' TensorFlow op library) hand gradient buffers
 * to the backend with no Python and no GIL in the step. A backend that can offers this
 * function table; its Python object returns it from CommBackend.native_comm() as a
 * PyCapsule named TNT_NATIVE_COMM_CAPSULE. A backend without it returns None and every
 * framework keeps the Python path. docs/architecture.md ("The native hand-off") is the
 * contract in words; tnt_core.testing's conformance suite checks it.
 *
 * Plain C, fixed-width types, no C++ or Python types: the producer and the consumer are
 * built separately, by different compilers, against different libraries.
 */
#ifndef TNT_NATIVE_COMM_H
#define TNT_NATIVE_COMM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TNT_NATIVE_COMM_CAPSULE "tnt_native_comm"
#define TNT_NATIVE_COMM_ABI_VERSION 1

/* element types: tnt_core.SUPPORTED_DTYPES, numbered in that order from 1 */
enum tnt_native_dtype {
  TNT_NATIVE_FLOAT16 = 1,
  TNT_NATIVE_FLOAT32 = 2,
  TNT_NATIVE_FLOAT64 = 3,
  TNT_NATIVE_INT32 = 4,
  TNT_NATIVE_INT64 = 5
};

/* reductions: tnt_core.REDUCE_OPS, numbered in that order from 0 */
enum tnt_native_op {
  TNT_NATIVE_SUM = 0,
  TNT_NATIVE_MIN = 1,
  TNT_NATIVE_MAX = 2,
  TNT_NATIVE_PRODUCT = 3
};

/* Called exactly once for every allreduce the backend accepted, from any thread (the
 * backend's worker, or the caller's own inside allreduce_async), never holding a lock the
 * caller could need. `error` is NULL on success, else a message naming the rank and the
 * operation, valid only during the call. It must not block: record and wake a waiter. */
typedef void (*tnt_native_done_fn)(void* arg, const char* error);

typedef struct tnt_native_comm {
  /* TNT_NATIVE_COMM_ABI_VERSION of the producer; a consumer refuses another major */
  uint32_t abi_version;
  /* sizeof(tnt_native_comm) of the producer: later versions only append fields */
  uint32_t struct_size;
  /* the backend's communicator, passed back as the first argument of every function. The
   * table and `self` stay valid while the capsule lives (it holds the communicator);
   * once the backend is closed, allreduce_async refuses. */
  void* self;
  int32_t rank;
  int32_t size;
  /* Start reducing `count` elements of `dtype` at `data` (host memory, writable) over all
   * ranks, in place, with `op`. Returns 0 when accepted: `done(arg, ...)` then follows
   * exactly once, and `data` must stay valid and untouched until it has. Returns non-zero
   * when refused (closed or failed communicator, bad argument): `done` is never called and
   * up to `errlen` bytes of a NUL-terminated message are written to `err`.
   *
   * Ordering: the allreduce goes out after every collective issued before it on this
   * communicator, through this table or through the Python methods, and before any
   * issued after it; every rank issues them in the same order (the contract's rule).
   * Never blocks on the network; safe from any thread; needs no GIL. */
  int32_t (*allreduce_async)(void* self, void* data, int64_t count, int32_t dtype,
                             int32_t op, tnt_native_done_fn done, void* arg, char* err,
                             int64_t errlen);
} tnt_native_comm;

#ifdef __cplusplus
}
#endif

#endif /* TNT_NATIVE_COMM_H */
