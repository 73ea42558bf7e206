"""``tnt.keras.callbacks.Callback(keras_callback, aggregate_logs=True, run_on_all_ranks=True)``."""

from ..callbacks import Callback

__all__ = ["Callback"]
