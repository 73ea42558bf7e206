"""The Keras 2 spellings of Horovod's TensorFlow 2 examples, accepted on Keras 3.

Horovod's examples were written for Keras 2 (``tf.keras``), and three of their spellings fail
on Keras 3 before any Horovod name matters:

* ``model.compile(..., experimental_run_tf_function=False)``. Keras 2 took the argument and
  ignored it from TensorFlow 2.2 on (its step was always a ``tf.function``); Keras 3 refuses
  arguments it does not know. Here it is taken and ignored again, as Keras 2 did.
* ``opt.variables()``. Keras 2's optimizers had a method; Keras 3's have a property that
  returns a list. The list the property returns here is also callable, returning itself as
  a plain list: ``opt.variables`` and ``opt.variables()`` give the same variables. It is a
  ``list`` subclass, so what Keras and TensorFlow do with it (iterate, index, ``len``,
  ``tf.nest``) is unchanged; Keras' TensorFlow backend applies no ``keras.tree`` function
  to it (an ``optree`` tree takes a list subclass for a leaf).
* ``opt.lr`` (the elastic examples' reset callbacks set the learning rate scaled with the
  new number of ranks through it, ``opt.lr.assign(...)`` and
  ``tf.keras.backend.set_value(opt.lr, ...)``). Keras 2's name of ``learning_rate``, which
  gave TensorFlow's variable; here too: the ``tf.Variable`` that holds Keras 3's
  ``learning_rate`` (a schedule's current value when the rate is a schedule). Setting
  ``opt.lr = x`` sets ``learning_rate``.

Importing ``tarantella.horovod`` installs them on Keras' classes (once; importing
``tarantella`` alone changes nothing), since the scripts call them on plain Keras objects.
``compile`` is replaced on the class that defines it, which is where loading a model looks
for Keras' own ``compile`` (``tarantella._keras_compat.compile_owner``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from .._keras_compat import compile_owner

__all__ = ["VariableList", "install"]

#: the functions this module put on Keras' classes (so that installing twice wraps once)
_OURS: set[Callable[..., Any]] = set()


class VariableList(list[Any]):
    """A list of an optimizer's variables that can also be called, as Keras 2's
    ``optimizer.variables()`` was."""

    @tf.autograph.experimental.do_not_convert  # tarantella's code: plain Python while traced
    def __call__(self) -> list[Any]:
        return list(self)


def _accepting_run_tf_function(compile_: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(compile_)
    def compile(self: keras.Model, *args: Any, experimental_run_tf_function: Any = None,
                **kwargs: Any) -> Any:
        """Keras' ``compile``; ``experimental_run_tf_function`` (Keras 2's, ignored there
        since TensorFlow 2.2) is taken and ignored."""
        return compile_(self, *args, **kwargs)

    _OURS.add(compile)
    return compile


def _callable_variables(variables: property) -> property:
    def getter(self: keras.optimizers.Optimizer) -> VariableList:
        return VariableList(variables.fget(self))  # type: ignore[misc]

    _OURS.add(getter)
    return property(getter, doc=variables.__doc__)


def _learning_rate_alias() -> property:
    def getter(self: keras.optimizers.Optimizer) -> Any:
        rate = self.learning_rate
        held = getattr(rate, "value", None)  # a Keras variable's TensorFlow variable
        return held if isinstance(held, tf.Variable) else rate

    def setter(self: keras.optimizers.Optimizer, value: Any) -> None:
        self.learning_rate = value

    _OURS.add(getter)
    return property(getter, setter, doc="Keras 2's name of ``learning_rate`` (TensorFlow's variable).")


def _optimizer_classes() -> list[type]:
    """Keras' public optimizer classes that define ``variables`` themselves."""
    classes = [keras.optimizers.Optimizer]
    classes += [cls for cls in vars(keras.optimizers).values()
                if inspect.isclass(cls) and issubclass(cls, keras.optimizers.Optimizer)
                and "variables" in vars(cls) and cls is not keras.optimizers.Optimizer]
    return classes


def install() -> None:
    """Accept the spellings on Keras' classes (idempotent)."""
    owner = compile_owner()  # where loading a model looks for Keras' own compile
    compile_ = vars(owner)["compile"]
    if compile_ not in _OURS:
        setattr(owner, "compile", _accepting_run_tf_function(compile_))  # noqa: B010 (a class)
    for cls in _optimizer_classes():
        variables = inspect.getattr_static(cls, "variables")
        if isinstance(variables, property) and variables.fget not in _OURS:
            cls.variables = _callable_variables(variables)  # type: ignore[attr-defined]
    base = keras.optimizers.Optimizer
    alias = inspect.getattr_static(base, "lr", None)
    if alias is None:
        base.lr = _learning_rate_alias()
