"""Saving and loading: ``tnt.models.save_model/load_model/clone_model/model_from_config/
model_from_json``.

Saving is a collective: the master writes (every rank with ``tnt_save_all_devices=True``),
to a temporary file that is renamed into place, and every rank returns once the file is
complete, so any rank may load it right after. Loading happens on every rank and returns a
``tnt.Model`` (compiled when the file holds a compiled model); the master's weights are
broadcast before the next step anyway.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import keras
import tnt_core

from .model import Model

__all__ = ["clone_model", "load_model", "model_from_config", "model_from_json", "save_model",
           "write_on_master"]

_SUFFIXES = (".weights.h5", ".weights.json", ".keras", ".h5", ".hdf5")


def _temporary_path(path: str) -> str:
    head, name = os.path.split(path)
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            break
    else:
        stem, suffix = os.path.splitext(name)
    return os.path.join(head, f".{stem}.tnt-tmp-{os.getpid()}{suffix}")


def write_on_master(write: Callable[[str], None], filepath: Any, *, overwrite: bool = True,
                    all_devices: bool = False, runtime: tnt_core.Runtime | None = None) -> None:
    """Run ``write(path)`` on the master (or every rank), atomically, then wait for it.

    Call on every rank. ``write`` gets a temporary path next to ``filepath`` that is renamed
    to ``filepath`` when complete.
    """
    runtime = runtime or tnt_core.init()
    path = os.fspath(filepath)
    error: BaseException | None = None
    if all_devices or runtime.is_master:
        if not overwrite and os.path.exists(path):
            error = FileExistsError(f"{path} exists and overwrite=False")
        else:
            tmp = _temporary_path(path)
            try:
                write(tmp)
                os.replace(tmp, path)
            except BaseException as exc:  # every rank must still reach the barrier
                error = exc
                if os.path.exists(tmp):
                    os.remove(tmp)
    if runtime.size > 1:
        runtime.backend.barrier()
    if error is not None:
        raise error


def save_model(model: Any, filepath: Any, overwrite: bool = True, *,
               tnt_save_all_devices: bool = False, **kwargs: Any) -> None:
    """Save a ``tnt.Model`` or ``keras.Model`` (``.keras``); the master writes. Collective."""
    keras_model = model.keras_model if isinstance(model, Model) else model
    runtime = model._tnt_runtime if isinstance(model, Model) else tnt_core.init()  # noqa: SLF001
    write_on_master(lambda path: keras_model.save(path, overwrite=True, **kwargs), filepath,
                    overwrite=overwrite, all_devices=tnt_save_all_devices, runtime=runtime)


def load_model(filepath: Any, custom_objects: dict | None = None, compile: bool = True,
               safe_mode: bool = True) -> Model:
    """Load a saved model on every rank as a ``tnt.Model`` (compiled if saved compiled)."""
    keras_model = keras.models.load_model(filepath, custom_objects=custom_objects,
                                          compile=compile, safe_mode=safe_mode)
    return Model(keras_model)


def clone_model(model: Any, *args: Any, **kwargs: Any) -> Model:
    """``keras.models.clone_model`` of a ``tnt.Model`` or Keras model, as a ``tnt.Model``
    (new weights, not compiled)."""
    keras_model = model.keras_model if isinstance(model, Model) else model
    return Model(keras.models.clone_model(keras_model, *args, **kwargs))


def model_from_config(config: dict, custom_objects: dict | None = None) -> Model:
    """A ``tnt.Model`` from a model's ``get_config()`` (or a serialized ``{"class_name":
    ..., "config": ...}`` dict); new weights."""
    if isinstance(config, dict) and "class_name" in config and "config" in config:
        keras_model = keras.models.model_from_json(json.dumps(config), custom_objects=custom_objects)
    elif isinstance(config, dict) and "layers" in config and "input_layers" not in config:
        keras_model = keras.Sequential.from_config(config, custom_objects=custom_objects)
    else:
        keras_model = keras.Model.from_config(config, custom_objects=custom_objects)
    return Model(keras_model)


def model_from_json(json_string: str, custom_objects: dict | None = None) -> Model:
    """A ``tnt.Model`` from ``to_json()`` output; new weights."""
    return Model(keras.models.model_from_json(json_string, custom_objects=custom_objects))
