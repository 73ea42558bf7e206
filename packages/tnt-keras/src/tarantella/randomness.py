"""Independent random streams per rank for the randomness inside the model.

Keras draws Dropout masks, noise and augmentations from the layers' ``SeedGenerator``
states, which ``keras.utils.set_random_seed`` makes equal on every rank: every rank would
then draw the *same* masks for *different* samples (correlated noise, unlike serial
training, where every sample gets its own draw). Each rank adds a rank-dependent offset to
the first word of every seed state once, after the model is built, so the streams are
independent across ranks yet reproducible for a given seed; rank 0 keeps the serial
stream. The states are rank-local: ``tarantella.data_parallel.weights`` never broadcasts them.
"""

from __future__ import annotations

import keras
import numpy as np

__all__ = ["SEED_STATE_NAME", "fold_rank_into_seeds", "is_seed_state", "refold_seed_state"]

#: the name Keras gives every ``keras.random.SeedGenerator``'s state variable
SEED_STATE_NAME = "seed_generator_state"
#: a large odd constant (the golden ratio's 64-bit fraction, halved to stay positive)
_STRIDE = 0x4F1BBCDCBFA53E0B


def is_seed_state(variable: keras.Variable) -> bool:
    """True for the state variable of a ``keras.random.SeedGenerator``."""
    return str(getattr(variable, "name", "")) == SEED_STATE_NAME


def fold_rank_into_seeds(model: keras.Model, rank: int) -> int:
    """Give rank ``rank`` its own stream in every seed state of ``model``; how many."""
    states = [v for v in model.variables if is_seed_state(v)]
    if rank == 0:
        return len(states)
    for v in states:
        v.assign(refold_seed_state(keras.ops.convert_to_numpy(v), 0, rank))
    return len(states)


def refold_seed_state(value: np.ndarray, rank: int, to_rank: int) -> np.ndarray:
    """The seed state rank ``to_rank`` holds where rank ``rank`` holds ``value`` (they
    drew alike since: Keras' ordered draws advance the second word only). A restarted rank
    takes its stream from a surviving replica of its stage this way
    (:mod:`tarantella.pipeline.rescue`)."""
    folded = np.array(value, dtype=np.int64)
    offset = ((to_rank - rank) * _STRIDE) % (2**62)
    folded[0] = (int(folded[0]) + offset) % (2**62)
    return folded.astype(np.asarray(value).dtype)
