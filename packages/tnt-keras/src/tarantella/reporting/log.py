"""The ``tarantella`` logger (a child of tnt-core's, so ``TNT_LOG_LEVEL`` applies), and the
one TensorFlow warning an elastic job's recovery would cause without cause."""

import logging

logger = logging.getLogger("tnt.keras")

#: how TensorFlow names Keras' own step functions in its warnings
_KERAS_STEP = "TensorFlowTrainer._make_function.<locals>."


class _KerasStepRetracing(logging.Filter):
    """Drops TensorFlow's "N out of the last M calls to <Keras' step function> triggered
    tf.function retracing": after an elastic rebind Keras makes its step functions anew on
    purpose (the old ones hold the old communicator), and TensorFlow counts each new one as
    a retrace of the same code. Other functions' warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("triggered tf.function retracing" in message and _KERAS_STEP in message)


_RETRACING = _KerasStepRetracing()


def quiet_keras_step_retracing() -> None:
    """After the first rebind: TensorFlow's retracing warning for Keras' step functions says
    nothing true any more. Idempotent."""
    tf_logger = logging.getLogger("tensorflow")
    if _RETRACING not in tf_logger.filters:
        tf_logger.addFilter(_RETRACING)
