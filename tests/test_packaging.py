"""Packaging guards: one version for every package, siblings pinned to it, complete
metadata, and the license the README states."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["tnt-core", "tnt-comm-gloo", "tnt-comm-mpi", "tnt-keras", "tnt-cli"]
VERSION = (ROOT / "VERSION").read_text().strip()


def pyproject(package: str) -> dict:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())


@pytest.mark.parametrize("package", PACKAGES)
def test_version_comes_from_the_one_version_file(package):
    project = pyproject(package)["project"]
    assert "version" not in project and "version" in project["dynamic"]
    text = (ROOT / "packages" / package / "pyproject.toml").read_text()
    assert '"../../VERSION"' in text, f"{package}: version not read from VERSION"
    assert metadata.version(package) == VERSION, (
        f"{package} is installed as {metadata.version(package)}, VERSION says {VERSION}: "
        f"reinstall it (pip install -e packages/{package})")


@pytest.mark.parametrize("package", PACKAGES)
def test_siblings_are_pinned_to_the_same_version(package):
    for dep in pyproject(package)["project"].get("dependencies", []):
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0)
        if name in PACKAGES:
            assert dep == f"{name}=={VERSION}", f"{package}: {dep!r} should be {name}=={VERSION}"


@pytest.mark.parametrize("package", PACKAGES)
def test_metadata_is_complete(package):
    project = pyproject(package)["project"]
    assert project["license"] == "Apache-2.0"
    assert project["authors"] == [{"name": "Tarantella-NT developers"}]
    assert project["classifiers"] and project["keywords"] and project["description"]
    assert "Programming Language :: Python :: 3.11" in project["classifiers"]
    assert project.get("urls") is None or all(
        "example" not in url for url in project["urls"].values())


@pytest.mark.parametrize("folder", [*(f"packages/{p}" for p in PACKAGES), "examples/tnt-comm-loopback"])
def test_every_distribution_ships_the_license(folder):
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert (ROOT / folder / "LICENSE").read_text() == license_text, f"{folder}/LICENSE differs"


def test_readme_states_the_license_and_the_changelog_has_this_version():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"## License\n.*Apache License 2\.0", readme, re.S)
    assert f"## [{VERSION}]" in (ROOT / "CHANGELOG.md").read_text()
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    for must in ("make test", "benchmarks/", "docs/plugins.md", "examples/tnt-comm-loopback"):
        assert must in contributing, must
