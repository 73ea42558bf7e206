"""A Keras backend other than TensorFlow is refused with one clear message.

Keras fixes its backend at import (``KERAS_BACKEND``), and the other backends need JAX or
PyTorch, which the test environment does not install; the check reads
``keras.backend.backend()``, so the test answers that call as Keras would under
``KERAS_BACKEND=torch``.
"""

from __future__ import annotations

import keras
import pytest

import tarantella as tnt


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_other_keras_backends_are_refused_clearly(monkeypatch, name):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    monkeypatch.setattr(keras.backend, "backend", lambda: name)
    with pytest.raises(tnt.NotSupportedError, match=f"KERAS_BACKEND={name}") as info:
        tnt.Model(model)
    assert "KERAS_BACKEND=tensorflow" in str(info.value), "the message says what is supported"
    assert not isinstance(model, tnt.Model), "a refused model stays as it was"


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_import_with_another_keras_backend_not_installed_gives_the_faqs_line(tmp_path, name):
    """Keras imports the backend's package when it is imported: without it installed,
    ``import tarantella`` showed Keras' own 20-line ModuleNotFoundError."""
    import importlib.util
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed")
    faq = (Path(__file__).resolve().parents[3] / "docs" / "faq.md").read_text()
    documented = re.search(r"^tarantella\.errors\.NotSupportedError: KERAS_BACKEND=jax: .*$", faq,
                           re.MULTILINE)
    assert documented, "docs/faq.md quotes the message"
    env = {**os.environ, "KERAS_BACKEND": name, "KERAS_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", "import tarantella"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == documented.group(0).replace("=jax", f"={name}"), proc.stderr
    assert len(lines) <= 6 and "ModuleNotFoundError" not in proc.stderr, proc.stderr
