"""Saving and loading: ``tnt.models.save_model/load_model/clone_model/model_from_config/
model_from_json``.

Saving is a collective: the master writes (every rank with ``tnt_save_all_devices=True``),
to a temporary file that is renamed into place, and every rank returns once the file is
complete, so any rank may load it right after. Loading happens on every rank and returns a
``tnt.Model`` (compiled when the file holds a compiled model); the master's weights are
broadcast before the next step anyway.
"""

from __future__ import annotations

from typing import Any

import keras

from .files import write_collectively
from .model import Model, keras_model_from_config

__all__ = ["clone_model", "load_model", "model_from_config", "model_from_json", "save_model",
           "write_on_master"]

#: the collective write under the name earlier releases exported
write_on_master = write_collectively


def save_model(model: Any, filepath: Any, overwrite: bool = True, *,
               tnt_save_all_devices: bool = False, **kwargs: Any) -> None:
    """Save a ``tnt.Model`` or ``keras.Model`` (a plain Keras file); the master writes.
    Collective: call on every rank."""
    if isinstance(model, Model):
        model.save(filepath, overwrite=overwrite, tnt_save_all_devices=tnt_save_all_devices,
                   **kwargs)
        return
    write_collectively(lambda path: keras.saving.save_model(model, path, overwrite=True, **kwargs),
                       filepath, overwrite=overwrite, all_devices=tnt_save_all_devices)


def load_model(filepath: Any, custom_objects: dict | None = None, compile: bool = True,
               safe_mode: bool = True) -> Model:
    """Load a saved model on every rank as a ``tnt.Model`` (compiled if saved compiled)."""
    keras_model = keras.models.load_model(filepath, custom_objects=custom_objects,
                                          compile=compile, safe_mode=safe_mode)
    return Model(keras_model)


def clone_model(model: Any, *args: Any, **kwargs: Any) -> Model:
    """``keras.models.clone_model`` of a ``tnt.Model`` or Keras model, as a ``tnt.Model``
    (new weights, not compiled)."""
    return Model(keras.models.clone_model(model, *args, **kwargs))


def model_from_config(config: dict, custom_objects: dict | None = None) -> Model:
    """A ``tnt.Model`` from a model's ``get_config()`` (or a serialized ``{"class_name":
    ..., "config": ...}`` dict); new weights."""
    return Model(keras_model_from_config(config, custom_objects=custom_objects))


def model_from_json(json_string: str, custom_objects: dict | None = None) -> Model:
    """A ``tnt.Model`` from ``to_json()`` output; new weights."""
    return Model(keras.models.model_from_json(json_string, custom_objects=custom_objects))
