"""Writing files from a data-parallel job: once, atomically, and never half-written.

Every writing API of ``tnt.Model`` (``save``, ``save_weights``, ``export``) and of
``tnt.models`` is a collective: the master writes (every rank with ``all_devices``) into a
temporary file next to the target that is renamed into place when complete, and every rank
returns once the file exists, so any rank may read it right after. A rank killed while it
writes leaves the temporary file, never a truncated file under the user's name.

Inside a callback that runs on the master only (ModelCheckpoint, BackupAndRestore...) the
other ranks are not there to wait: :func:`local_writes` makes the same calls write on this
rank alone (still atomically) without waiting for anyone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import tnt_core

from . import comm

__all__ = ["agree", "attempt_write", "local_writes", "write_collectively", "writes_locally",
           "written_whole"]

_SUFFIXES = (".weights.h5", ".weights.json", ".keras", ".h5", ".hdf5")
_local = threading.local()


@contextlib.contextmanager
def local_writes() -> Iterator[None]:
    """Writes inside this block happen on this rank alone (master-only callbacks)."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def writes_locally() -> bool:
    """True inside :func:`local_writes` (a master-only callback): no collective may run."""
    return getattr(_local, "depth", 0) > 0


def _temporary_path(path: str) -> str:
    head, name = os.path.split(path)
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            break
    else:
        stem, suffix = os.path.splitext(name)
    return os.path.join(head, f".{stem}.tnt-tmp-{os.getpid()}{suffix}")


@contextlib.contextmanager
def written_whole(owner: Any, attribute: str, *, keep_content: bool = False) -> Iterator[None]:
    """A file that code not ours writes in place, its path in ``owner.<attribute>`` (Keras'
    ``BackupAndRestore`` writes its ``training_metadata.json`` so), written whole: inside the
    block the attribute names a temporary file next to it, renamed into place afterwards if
    the block wrote it. A writer killed in the middle leaves the hidden temporary file and
    the previous file whole, never an empty or truncated one. ``keep_content``: the
    temporary file starts as a copy of the file (for code that reads or copies the file
    before it writes)."""
    path = getattr(owner, attribute, None)
    if not isinstance(path, str):  # not where this Keras keeps it: written as Keras writes
        yield
        return
    tmp = _temporary_path(path)
    _remove(tmp)
    if keep_content and os.path.isfile(path):
        shutil.copyfile(path, tmp)
    setattr(owner, attribute, tmp)
    try:
        yield
    except BaseException:
        _remove(tmp)
        raise
    finally:
        setattr(owner, attribute, path)
    if os.path.lexists(tmp):
        os.replace(tmp, path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _write_atomically(write: Callable[[str], None], path: str) -> None:
    tmp = _temporary_path(path)
    try:
        write(tmp)
        if os.path.isdir(tmp) and os.path.isdir(path):  # an export directory: replace it
            _remove(path)
        os.replace(tmp, path)
    except BaseException as exc:
        _remove(tmp)
        if isinstance(exc, Exception) and tmp in str(exc):  # name the user's path, not ours
            try:
                renamed = type(exc)(str(exc).replace(tmp, path))
            except Exception:  # noqa: BLE001 (a type that takes other arguments: keep it as it is)
                raise exc from None
            raise renamed from None
        raise


def attempt_write(write: Callable[[str], None], path: str, *, overwrite: bool = True) -> BaseException | None:
    """``write`` atomically to ``path`` (a temporary path renamed into place); the error, if
    any, returned instead of raised, so that the caller first reaches :func:`agree` with the
    other ranks."""
    if not overwrite and os.path.exists(path):
        return FileExistsError(f"{path} exists and overwrite=False")
    try:
        _write_atomically(write, path)
    except BaseException as exc:  # noqa: BLE001 (every rank must still reach the agreement)
        return exc
    return None


def agree(runtime: tnt_core.Runtime, error: BaseException | None, path: str) -> None:
    """After a collective write: raise ``error`` here, and on every rank when any rank's
    write failed (a collective: also a barrier)."""
    failed = _any_rank(runtime, error is not None) if runtime.size > 1 else False
    if error is not None:
        raise error
    if failed:
        raise OSError(f"writing {path} failed on another rank (its error is in its output)")


def write_collectively(write: Callable[[str], None], filepath: Any, *, overwrite: bool = True,
                       all_devices: bool = False, runtime: tnt_core.Runtime | None = None) -> None:
    """Run ``write(path)`` on the master (or every rank), atomically, then wait for it.

    Call on every rank. ``write`` gets a temporary path next to ``filepath`` that is renamed
    to ``filepath`` when complete. An error on the writing rank is raised on every rank.
    """
    runtime = runtime or tnt_core.init()
    path = os.fspath(filepath)
    local = writes_locally()
    error: BaseException | None = None
    if local or all_devices or runtime.is_master:
        error = attempt_write(write, path, overwrite=overwrite)
    if local:
        if error is not None:
            raise error
        return
    agree(runtime, error, path)


def _any_rank(runtime: tnt_core.Runtime, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any (also a barrier)."""
    buf = np.array([1 if flag else 0], dtype=np.int32)
    comm.world(runtime).backend.allreduce(buf, "max")
    return bool(buf[0])
