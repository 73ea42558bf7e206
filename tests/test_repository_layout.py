"""Guards on how the packages fit together: entry-point groups, layout, the README's
set-up and CI calling exactly the README's test command."""

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["tnt-core", "tnt-comm-gloo", "tnt-comm-mpi", "tnt-keras", "tnt-cli"]


def pyproject(package):
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())


@pytest.mark.parametrize("package", PACKAGES)
def test_package_layout(package):
    base = ROOT / "packages" / package
    assert (base / "pyproject.toml").is_file()
    assert (base / "README.md").is_file()
    assert (base / "tests").is_dir()
    assert (base / "src").is_dir(), "src/ layout"
    assert pyproject(package)["project"]["name"] == package


@pytest.mark.parametrize("package", PACKAGES)
def test_entry_points_use_the_tnt_group_only(package):
    """A typo in a group name would silently hide a plugin; catch it here."""
    groups = pyproject(package)["project"].get("entry-points", {})
    for group in groups:
        assert group == "tnt", f"{package}: unexpected entry-point group {group!r}"
    dist = metadata.distribution(package)
    for ep in dist.entry_points:
        if ep.group not in ("console_scripts",):
            assert ep.group == "tnt", f"{package}: installed entry point in group {ep.group!r}"
            ep.load()  # the module it names imports


def test_no_package_imports_tensorflow_into_tnt_core():
    for path in (ROOT / "packages/tnt-core/src").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+(tensorflow|keras)\b", text, re.M), path


def test_readme_has_exactly_the_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^```(?:console|sh|bash)?\n(.*?)```", setup, re.M | re.S)
    lines = [line.strip().lstrip("$ ").strip()
             for block in commands for line in block.splitlines() if line.strip()]
    assert lines == ["make run", "make test"], lines
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci == ["make test"], ci


def test_tnt_keras_keeps_its_rooms():
    """tnt-keras shows its architecture: the strategies, communication, custom loops and the
    Keras seams in sub-packages, at most 15 modules left at the top."""
    top = ROOT / "packages" / "tnt-keras" / "src" / "tarantella"
    modules = sorted(p.name for p in top.glob("*.py"))
    assert len(modules) <= 15, modules
    for room in ("comm", "data_parallel", "pipeline", "loops", "horovod", "keras", "seams"):
        assert (top / room / "__init__.py").is_file(), room
