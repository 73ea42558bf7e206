"""The ``_gloo.pyi`` stub describes exactly what the native module exports."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from tnt_comm_gloo import _gloo

STUB = Path(_gloo.__file__).with_name("_gloo.pyi")
if not STUB.exists():  # editable installs keep the stub in the source tree
    STUB = Path(__file__).resolve().parents[1] / "src" / "tnt_comm_gloo" / "_gloo.pyi"


def _stub_names() -> dict[str, set[str]]:
    tree = ast.parse(STUB.read_text())
    names: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names[""].add(node.name)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            names[""].add(node.name)
            names[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    return names


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def test_module_level_names_match() -> None:
    native = {n for n in _public(_gloo) if not inspect.ismodule(getattr(_gloo, n))}
    assert native == _stub_names()[""]


def test_class_members_match() -> None:
    stub = _stub_names()
    for cls in ("Work", "Communicator"):
        native = _public(getattr(_gloo, cls))
        assert native == stub[cls], f"{cls}: native {sorted(native)} vs stub {sorted(stub[cls])}"


def test_glooerror_is_an_exception() -> None:
    assert issubclass(_gloo.GlooError, Exception)
