/* tnt_stall_ledger.h: the stall inspector's ledger as compiled code sees it, ABI 1.
 *
 * Why: compiled framework ops (tnt-keras' op library) start allreduces through a backend's
 * native table (tnt_native_comm.h) with no Python in the step. The stall inspector must
 * still count them and know when a rank waits in one, or a rank that never reaches a
 * gradient allreduce cannot be named. So the ledger's counters are this struct, in memory
 * tnt-core owns (the Ledger of its _stall_ledger.py): the Python path and the op
 * library number their collectives in the same counter, and the inspector's thread reads
 * it as it always did, only when it publishes or judges a stall. No call into Python, no
 * lock: a consumer does one atomic add per allreduce it starts, and two clock reads and a
 * few stores when it blocks. docs/architecture.md ("The stall inspector") is the contract
 * in words.
 *
 * A consumer gets the struct's address with the native table (tnt_core.NativeComm.ledger;
 * 0 when the job keeps no ledger: a single rank, or a backend not wrapped by tnt-core).
 * It stays valid while that NativeComm lives.
 */
#ifndef TNT_STALL_LEDGER_H
#define TNT_STALL_LEDGER_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TNT_STALL_LEDGER_ABI_VERSION 1

/* the collective a rank waits in (_stall_ledger.py's names, in this order from 1) */
enum tnt_stall_op {
  TNT_STALL_NONE = 0,
  TNT_STALL_ALLREDUCE = 1,
  TNT_STALL_BROADCAST = 2,
  TNT_STALL_ALLGATHER = 3,
  TNT_STALL_BARRIER = 4,
  TNT_STALL_SPLIT = 5
};

typedef struct tnt_stall_ledger {
  /* TNT_STALL_LEDGER_ABI_VERSION of tnt-core; a consumer refuses another */
  uint32_t abi_version;
  /* sizeof(tnt_stall_ledger) of tnt-core: later versions only append fields */
  uint32_t struct_size;
  /* Collectives this rank has entered. Every rank enters the same collectives in the same
   * order (the contract's rule), so the count is a position comparable across ranks. A
   * consumer numbers each allreduce it starts with __atomic_add_fetch(&entered, 1, ...),
   * just before it hands it to the table. (Python adds without an atomic; the contract
   * already keeps Python-path launches and native ones from overlapping.) */
  int64_t entered;
  /* The collective this rank blocks in (its number, 1-based), 0 while it blocks in none.
   * A consumer that blocks on the number `seq` writes waiting_since and waiting_op first,
   * then sets waiting_for = seq, and clears it when the wait ends (or after it has
   * reported the wait's failure, so that the report can name `seq`). It leaves all three
   * alone when waiting_for is already set: an outer wait keeps its start. */
  int64_t waiting_for;
  /* CLOCK_MONOTONIC seconds (Python's time.monotonic) when that wait began */
  double waiting_since;
  /* enum tnt_stall_op of that wait */
  int32_t waiting_op;
  int32_t reserved;
} tnt_stall_ledger;

#ifdef __cplusplus
}
#endif

#endif /* TNT_STALL_LEDGER_H */
