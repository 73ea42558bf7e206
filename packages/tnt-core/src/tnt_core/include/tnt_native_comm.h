/* tnt_native_comm.h: the native hand-off of the CommBackend contract (optional), ABI 3.
 *
 * Why: a framework's compiled ops (tnt-keras' TensorFlow op library) hand gradient buffers,
 * and a pipeline's activations and gradients, to the backend with no Python and no GIL in
 * the step. A backend that can offers this
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

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TNT_NATIVE_COMM_CAPSULE "tnt_native_comm"
/* Versions only append fields: a table of version V starts with every field of the
 * versions before it. A consumer takes any version >= 1 whose struct_size covers the fields
 * it reads, and uses an entry only where tnt_native_comm_has_*() says the table has it.
 *   1: allreduce_async
 *   2: send_async, recv_async, abort (point-to-point)
 *   3: allreduce_gather_async (an allreduce whose input is gathered from pieces) */
#define TNT_NATIVE_COMM_ABI_VERSION 3
#define TNT_NATIVE_COMM_ABI_P2P 2
#define TNT_NATIVE_COMM_ABI_GATHER 3

/* Point-to-point tags are in [0, TNT_NATIVE_MAX_TAG]: the tags of the CommBackend
 * contract's send_async/recv_async (on the gloo backend, its MAX_TAG). */
#define TNT_NATIVE_MAX_TAG 2147483647LL

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

/* Called exactly once for every operation the backend accepted, from any thread (the
 * backend's worker or point-to-point threads, or the caller's own inside the call that
 * started it), never holding a lock the caller could need. `error` is NULL on success, else a message naming the rank and the
 * operation, valid only during the call. It must not block: record and wake a waiter. */
typedef void (*tnt_native_done_fn)(void* arg, const char* error);

typedef struct tnt_native_comm {
  /* TNT_NATIVE_COMM_ABI_VERSION of the producer (see above: later versions append) */
  uint32_t abi_version;
  /* sizeof(tnt_native_comm) of the producer: later versions only append fields */
  uint32_t struct_size;
  /* the backend's communicator, passed back as the first argument of every function. The
   * table and `self` stay valid while the capsule lives (it holds the communicator);
   * once the backend is closed, every entry refuses (abort does nothing). */
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

  /* ---- ABI 2: point-to-point (tnt_native_comm_has_p2p) ----
   *
   * Start sending `nbytes` bytes at `data` (host memory, read until `done`) to rank `peer`
   * with `tag` (0 to TNT_NATIVE_MAX_TAG) / receiving the next message from rank `peer`
   * with `tag` into `nbytes` bytes at `data` (written until `done`). Returns and `done`
   * follow the rules of allreduce_async: 0 when accepted, then `done(arg, ...)` exactly
   * once (NULL on success, else a message naming the rank and the operation; a message
   * of another byte size fails that receive); non-zero when refused (closed or failed
   * communicator, bad argument, a peer known to be gone), with the reason in `err` and
   * no `done`.
   *
   * The messages are the Python methods' (CommBackend.send_async/recv_async): one stream
   * per (peer, tag), in the order sent, whichever path sent or receives them; different
   * tags are independent; a receive may be posted before or after its send. They are not
   * collectives: never ordered behind one, never counted in the stall ledger, and they
   * never share the transport's channels with the collectives (allreduce traffic cannot
   * match a receive). Never blocks on the network; safe from any thread; needs no GIL.
   *
   * A dead peer fails the operations waiting for it (their `done` reports it) without any
   * timeout; the backend enforces none on point-to-point: a consumer that gives up on a
   * wait (TNT_TIMEOUT_S) calls abort(). */
  int32_t (*send_async)(void* self, const void* data, int64_t nbytes, int32_t peer,
                        int64_t tag, tnt_native_done_fn done, void* arg, char* err,
                        int64_t errlen);
  int32_t (*recv_async)(void* self, void* data, int64_t nbytes, int32_t peer, int64_t tag,
                        tnt_native_done_fn done, void* arg, char* err, int64_t errlen);
  /* Fail the communicator with `reason` (NUL-terminated; the first reason wins), as a
   * timed-out wait of the Python path does: every pending operation completes with the
   * failure (its `done` called once the backend no longer touches its buffer) and every
   * later one is refused. Never blocks on the network; safe from any thread, also after
   * close. */
  void (*abort)(void* self, const char* reason);

  /* ---- ABI 3: the allreduce of gathered pieces (tnt_native_comm_has_gather) ----
   *
   * Start reducing over all ranks, with `op`, the `count` elements of `dtype` made of
   * `nparts` pieces: piece i is `counts[i]` elements at `srcs[i]` (host memory, read until
   * `done`, never written), each multiplied by `factor` in the element type (src * (T)factor;
   * 1.0 copies, 0.0 gives zeros whatever the source holds), at element `offsets[i]`; the
   * elements no piece covers are zeros. The result goes to `out` (`count` elements, written
   * until `done`; it may hold anything before). Pieces lie within [0, count), do not
   * overlap, come in any order; the three arrays are read during the call only. Returns,
   * `done`, ordering and threads: as allreduce_async. The result is what allreduce_async
   * gives for a buffer the caller filled that way.
   *
   * Why: a framework's gradients are separate tensors; without this entry it copies them
   * into one buffer first, and the backend copies that buffer again into its transport's
   * (a shared-memory slot, a send buffer). Given the pieces, the backend makes the one copy
   * it needs. */
  int32_t (*allreduce_gather_async)(void* self, const void* const* srcs, const int64_t* counts,
                                    const int64_t* offsets, int32_t nparts, double factor,
                                    void* out, int64_t count, int32_t dtype, int32_t op,
                                    tnt_native_done_fn done, void* arg, char* err,
                                    int64_t errlen);
} tnt_native_comm;

/* The size of an ABI 1 table: what every version starts with. */
#define TNT_NATIVE_COMM_SIZE_V1 (offsetof(tnt_native_comm, allreduce_async) + sizeof(void*))

/* Whether `t` has the point-to-point entries (send_async, recv_async, abort). */
static inline int tnt_native_comm_has_p2p(const tnt_native_comm* t) {
  return t->abi_version >= TNT_NATIVE_COMM_ABI_P2P &&
         t->struct_size >= offsetof(tnt_native_comm, abort) + sizeof(void*);
}

/* Whether `t` has allreduce_gather_async. */
static inline int tnt_native_comm_has_gather(const tnt_native_comm* t) {
  return t->abi_version >= TNT_NATIVE_COMM_ABI_GATHER &&
         t->struct_size >= offsetof(tnt_native_comm, allreduce_gather_async) + sizeof(void*) &&
         t->allreduce_gather_async != NULL;
}

#ifdef __cplusplus
}
#endif

#endif /* TNT_NATIVE_COMM_H */
