"""The docs' TNT_* variables against their declarations: tnt-core's (tnt_core.VARIABLES) and
those the installed plugins declare through ``tnt_register_settings``.

* The variable tables of the docs are generated (``{tnt-env-table}``) from the declarations,
  the plugins' groups from whatever plugins are installed (``installed``).
* Every default the docs and the READMEs state for a ``TNT_*`` variable, in a table's
  "default" column or as "(default N)" next to its name, equals the code's default.
* No file of the repository cites a design document that is not in it.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

tnt_docs = pytest.importorskip("tnt_docs")
tnt_core = pytest.importorskip("tnt_core")


def _declared() -> dict:
    """Every declared variable by name: tnt-core's, the installed plugins', and the example
    plugin's (the docs and its README name its setting; it is installed only while
    tests/test_example_plugin.py runs), imported from its source."""
    sys.path.insert(0, str(ROOT / "examples" / "tnt-comm-loopback" / "src"))
    example = importlib.import_module("tnt_comm_loopback.plugin")
    return {**tnt_core.installed_settings().variables, **example.SETTINGS.variables}


DECLARED = _declared()

NAME = re.compile(r"\bTNT_[A-Z0-9_]*[A-Z0-9]\b")
#: "`TNT_X` ... default 2048" / "(TNT_X; default 1800)" / "default 2 MB", in one cell or sentence
PROSE_DEFAULT = re.compile(r"`?(TNT_[A-Z0-9_]*[A-Z0-9])`?[^\n.]{0,80}?\bdefault:? `?(\d[\d.]*)`?"
                           r"(?:\s*(MiB|KiB|MB|KB|s)\b)?")
#: what a unit after a stated default multiplies it by, for a variable's own unit
UNITS = {("_KB", "MB"): 1024, ("_BYTES", "KiB"): 1 << 10, ("_BYTES", "MiB"): 1 << 20}
UNSET = {"unset", "—", "-", "none", ""}


def _pages() -> list[Path]:
    pages = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]
    pages += sorted(ROOT.glob("packages/*/README.md")) + sorted(ROOT.glob("examples/*/README.md"))
    return [p for p in pages if p.exists()]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _agrees(var, stated: str) -> bool:
    """Whether ``stated`` (a table cell) says ``var``'s default."""
    stated = stated.strip()
    plain = stated.strip("`").strip()
    default = var.default
    if default is None or default == []:
        if plain.lower() in UNSET:
            return True
        doc = var.default_doc or ""
        literal = re.match(r"`([^`]+)`", doc)
        if literal and (_number(plain) is not None or stated.startswith("`")):
            return plain == literal.group(1)
        return True  # a computed default said in words: nothing to compare
    if isinstance(default, bool):
        return plain.lower() == var.format(default)
    if isinstance(default, (int, float)):
        number = re.match(r"`?(-?\d[\d.]*)", stated)
        return bool(number) and float(number.group(1)) == float(default)
    return plain.lower() == str(default).lower()


def _table_defaults():
    """(page, variable, stated default) of every table row naming one TNT_* variable in a
    table whose header has a "default" column."""
    for page in _pages():
        header: list[str] | None = None
        for line in page.read_text().splitlines():
            if not line.startswith("|"):
                header = None
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = [c.lower() for c in cells]
                continue
            if set(line) <= set("|-: ") or "default" not in header:
                continue
            names = NAME.findall(cells[0])
            if len(names) == 1 and len(cells) == len(header):
                yield page, names[0], cells[header.index("default")]


def test_every_table_default_of_a_tnt_variable_is_the_codes():
    checked, wrong = 0, []
    for page, name, stated in _table_defaults():
        assert name in DECLARED, f"{page.name}: {name} is not declared"
        checked += 1
        if not _agrees(DECLARED[name], stated):
            wrong.append(f"{page.relative_to(ROOT)}: {name} default {stated!r}, code: "
                         f"{DECLARED[name].default_text}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 12  # the backend READMEs' tables at least


def test_every_default_stated_next_to_a_tnt_variable_is_the_codes():
    checked, wrong = 0, []
    for page in _pages():
        for match in PROSE_DEFAULT.finditer(page.read_text()):
            name, value, unit = match.groups()
            var = DECLARED.get(name)
            if var is None or not isinstance(var.default, (int, float)) or isinstance(var.default, bool):
                continue
            scale = next((f for (suffix, u), f in UNITS.items() if u == unit and name.endswith(suffix)), 1)
            stated = float(value) * scale
            checked += 1
            if stated != float(var.default):
                wrong.append(f"{page.relative_to(ROOT)}: {match.group(0)!r}, code: {var.default_text}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 3


def test_the_check_catches_a_wrong_default():
    fusion = DECLARED["TNT_FUSION_THRESHOLD_KB"]
    assert not _agrees(fusion, "32") and _agrees(fusion, "`2048` (2 MB)")
    assert _agrees(DECLARED["TNT_OVERLAP"], "`true`")
    assert not _agrees(DECLARED["TNT_GLOO_SHM_SPIN_US"], "`20`")
    match = PROSE_DEFAULT.search("threshold (`TNT_FUSION_THRESHOLD_KB`, default 2 MB)")
    assert match and match.groups() == ("TNT_FUSION_THRESHOLD_KB", "2", "MB")
    match = PROSE_DEFAULT.search("`TNT_GLOO_SHM_CHUNK_BYTES` (default 1 MiB)")
    assert match and match.groups() == ("TNT_GLOO_SHM_CHUNK_BYTES", "1", "MiB")


def test_every_tnt_variable_the_docs_name_is_declared():
    named = set()
    for page in _pages():
        named |= set(NAME.findall(page.read_text()))
    named = {n for n in named if "_TEST_" not in n and not n.startswith("TNT_TEST_")}  # tests' own
    assert not sorted(named - set(DECLARED))


def test_env_table_renders_the_declarations():
    text = "\n".join(tnt_docs.env_table(["launcher"], ["variable", "option", "default", "meaning"]))
    assert "| variable | `tnt run` option | default | meaning |" in text
    assert "| `TNT_FUSION_THRESHOLD_KB` | `--fusion-threshold` | `2048` (2 MB) |" in text
    assert "| `TNT_TIMEOUT_S` | `--timeout` | `1800` |" in text
    installed = tnt_core.installed_settings()
    every = "\n".join(tnt_docs.env_table(list(installed.groups)))
    for name in installed.variables:
        assert f"`{name}`" in every
    with pytest.raises(ValueError, match="unknown group"):
        tnt_docs.env_table(["nope"])


def test_installed_stands_for_every_installed_plugins_settings():
    """A plugin registered now, declaring its settings through the hook, gets its table."""
    group = tnt_core.SettingGroup("docs-test", "the docs-test plugin", prefix="TNT_DOCS_TEST_")
    group.declare("TNT_DOCS_TEST_N", "int", 3, "a test setting")

    class Plugin:
        @tnt_core.hookimpl
        def tnt_register_settings(self, registry):
            registry.add(group)

    tnt_core.reset_plugin_manager()
    try:
        tnt_core.get_plugin_manager().register(Plugin(), name="docs_test")
        text = "\n".join(tnt_docs.env_table(["plugins", "installed"]))
        assert ":::{rubric} The docs-test plugin" in text
        assert "| `TNT_DOCS_TEST_N` | `3` | a test setting |" in text
        for other in tnt_core.installed_settings().plugin_groups:  # gloo, mpi, ... when installed
            assert f":::{{rubric}} {other.title[0].upper() + other.title[1:]}" in text
    finally:
        tnt_core.reset_plugin_manager()


@pytest.mark.parametrize("page, groups", [
    ("architecture.md", "launcher settings plugins installed internal"),
    ("advanced.md", "launcher settings plugins"),
    ("cli.md", "launcher"),
])
def test_the_variable_tables_of_the_docs_are_generated(page, groups):
    text = (DOCS / page).read_text()
    assert f"```{{tnt-env-table}} {groups}" in text
    assert "| `TNT_FUSION_THRESHOLD_KB` |" not in text  # no hand-written table beside it


def test_architecture_holds_the_contracts():
    text = (DOCS / "architecture.md").read_text()
    for part in ("### Hook specifications", ".. automodule:: tnt_core._hookspecs",
                 "### The `CommBackend` contract", ".. autoclass:: tnt_core.CommBackend",
                 ".. autoclass:: tnt_core.Handle", "### The launcher contract"):
        assert part in text


def test_nothing_cites_a_design_document_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".cfg", ".txt", ".cpp", ".h", ".pyi", ".ini"}:
            continue
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "DESIGN" + ".md" in line:
                hits.append(f"{name}:{number}")
    assert not hits, f"cite docs/architecture.md instead: {hits}"
