"""The wheels as a user gets them (issue 18: ``pip install`` on a cluster node without root).

``ci/build-wheels.sh`` builds the five wheels (cached by source hash, so a repeated run
copies them); then, in a mount namespace of its own, with Gloo's headers, library and
CMake package and every compiler and CMake hidden (empty mounts over them), a fresh venv
gets them with the README's command: pip resolves it (``--dry-run``: every requirement of
the five wheels found, from the wheels and the index), and uv's pip interface installs
that same set (pip would spend most of this test unpacking TensorFlow; uv links it from its
cache). Then

* the installed ``tnt_comm_gloo`` is the manylinux wheel, with no libgloo it needs;
* ``tnt run -n 2`` trains the quick-start example (``examples/quickstart/lenet5.py``) for
  one epoch, equal to serial training, the master alone printing (the example's only run:
  the same command from the editable install would show nothing more);
* every case of tnt-core's conformance suite passes on the gloo backend from that venv, in
  one job of 2 ranks: shared memory, Gloo's TCP collectives and point-to-point, groups and
  the native hand-off of the wheel's module. The other sizes, settings and the dead peer
  test the same sources, which ``packages/tnt-comm-gloo/tests`` runs from the editable
  install.

A second test builds the tnt-comm-gloo sdist with the compiler there but Gloo hidden: it
fails with the one line naming the wheel and Debian's libgloo-dev.

Nothing is skipped when something is broken; the only skip is a machine where a mount
namespace cannot be made (neither root nor user namespaces).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: uv (ci/requirements-test.txt), the installer of the fresh venv
UV = Path(sys.executable).with_name("uv")
BUILD_TIMEOUT_S = 900   # the first build on a machine fetches and compiles Gloo (~2 min here)
pytestmark = pytest.mark.timeout(1800)

# programs a user's node may lack; each one found on PATH is covered by an empty mount
BUILD_TOOLS = ["cmake", "gcc", "g++", "cc", "c++", "cpp", "clang", "clang++",
               "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++", "gcc-12", "g++-12"]


def _unshare_argv() -> list[str]:
    """``unshare`` for a private mount namespace, or skip when none can be made here."""
    if shutil.which("unshare") is None:
        pytest.skip("`unshare` (util-linux) is not installed: no mount namespace for the clean install")
    argv = ["unshare", "-m", "--propagation", "private"]
    if os.geteuid() != 0:
        argv.insert(1, "-Ur")   # a user namespace maps us to root inside it
    probe = subprocess.run([*argv, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        if os.geteuid() == 0:
            pytest.fail(f"`unshare -m` fails as root: {probe.stderr.strip()}")
        pytest.skip(f"no mount namespace: not root and no user namespaces ({probe.stderr.strip()})")
    return argv


def _hide_prelude(work: Path, hide_build_tools: bool) -> str:
    """Bash that hides Gloo (and the build tools) in this mount namespace, then checks it.

    Gloo's directories get an empty tmpfs, its library an empty file; each directory of
    PATH holding a build tool gets an overlay whose whiteouts delete the tool (and its
    alternatives' links), so that neither PATH nor /usr/bin has it."""
    tools = " ".join(BUILD_TOOLS) if hide_build_tools else ""
    return textwrap.dedent(f"""\
        set -euo pipefail
        work={shlex.quote(str(work))}
        : >"$work/empty"
        hide_dir() {{ if [ -d "$1" ]; then mount -t tmpfs -o size=1m tmpfs "$1"; fi; }}
        hide_dir /usr/include/gloo
        hide_dir /usr/share/cmake/Gloo
        for f in /usr/lib/libgloo.so* /usr/lib/*-linux-gnu/libgloo.so* /usr/local/lib/libgloo*; do
          if [ -f "$f" ]; then mount --bind "$work/empty" "$(readlink -f "$f")"; fi
        done
        declare -A whiteouts=()
        IFS=: read -r -a dirs <<<"$PATH:/usr/bin:/usr/local/bin"
        for tool in {tools}; do
          for d in "${{dirs[@]}}"; do
            if [ -d "$d" ] && {{ [ -e "$d/$tool" ] || [ -L "$d/$tool" ]; }}; then
              real=$(readlink -f "$d"); whiteouts[$real]="${{whiteouts[$real]:-}} $tool"
            fi
          done
        done
        n=0
        for d in "${{!whiteouts[@]}}"; do
          n=$((n + 1)); mkdir -p "$work/overlay$n/upper" "$work/overlay$n/work"
          for tool in ${{whiteouts[$d]}}; do
            [ -e "$work/overlay$n/upper/$tool" ] || mknod "$work/overlay$n/upper/$tool" c 0 0
          done
          mount -t overlay overlay \
            -o "lowerdir=$d,upperdir=$work/overlay$n/upper,workdir=$work/overlay$n/work" "$d"
        done
        # what a user's node lacks is really absent here
        if [ -e /usr/include/gloo/allreduce.h ] || [ -e /usr/share/cmake/Gloo/GlooConfig.cmake ]; then
          echo "CHECK-FAILED: Gloo's headers or CMake package are still visible"; exit 1
        fi
        if python3 -c 'import ctypes; ctypes.CDLL("libgloo.so.0")' 2>/dev/null \
           || python3 -c 'import ctypes; ctypes.CDLL("libgloo.so")' 2>/dev/null; then
          echo "CHECK-FAILED: libgloo still loads"; exit 1
        fi
        for tool in {tools}; do
          if command -v "$tool" >/dev/null || [ -e "/usr/bin/$tool" ]; then
            echo "CHECK-FAILED: $tool is still there: $(command -v "$tool")"; exit 1
          fi
        done
        echo "HIDDEN-OK"
        """)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheels and sdists of ``make wheels`` (cached builds are reused)."""
    out = tmp_path_factory.mktemp("dist")
    start = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "ci" / "build-wheels.sh")], cwd=ROOT,
                          env={**os.environ, "DIST": str(out)}, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    assert proc.returncode == 0, f"ci/build-wheels.sh failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    print(f"ci/build-wheels.sh: {time.monotonic() - start:.1f} s")
    wheels = sorted(p.name for p in out.glob("*.whl"))
    assert len(wheels) == 5, wheels
    gloo = [w for w in wheels if w.startswith("tnt_comm_gloo-")]
    assert gloo and re.search(r"-cp311-cp311-manylinux_2_\d+_x86_64\.whl$", gloo[0]), gloo
    return out


def _run_namespaced(script: str, work: Path, timeout: float) -> tuple[str, float]:
    path = work / "scenario.sh"
    path.write_text(script)
    start = time.monotonic()
    proc = subprocess.run([*_unshare_argv(), "bash", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items()
                               # the clean venv gets none of this run's settings: a
                               # PYTEST_ADDOPTS naming a plugin would fail its pytest
                               if not k.startswith(("TNT_", "VIRTUAL_ENV", "PYTHON", "PYTEST_"))})
    out = proc.stdout + "\n[stderr]\n" + proc.stderr
    assert "CHECK-FAILED" not in out, out[-8000:]
    assert "HIDDEN-OK" in out, f"hiding Gloo and the build tools failed:\n{out[-8000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-12000:]}"
    return out, time.monotonic() - start


def test_clean_install_trains_and_passes_conformance(dist: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    python = Path(sys.executable).resolve()  # the same interpreter as the suite's (3.11)
    base_python = subprocess.run([str(python), "-c", "import sys; print(sys._base_executable)"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
    q = shlex.quote
    script = _hide_prelude(tmp_path, hide_build_tools=True) + textwrap.dedent(f"""\
        export PATH={q(str(venv / "bin"))}:$PATH TF_CPP_MIN_LOG_LEVEL=3 PYTHONWARNINGS=ignore
        stamp() {{ date +%s.%N; }}
        echo "T-INSTALL-START $(stamp)"
        timeout 60 {q(base_python)} -m venv {q(str(venv))}
        # the README's command; scikit-learn: the quick start's data set, [test]: pytest for
        # the conformance suite. Third-party wheels come from PyPI. pip resolves, uv installs.
        requirements="tnt-keras tnt-comm-gloo[test] tnt-cli scikit-learn"
        timeout 900 pip install --dry-run --disable-pip-version-check -q \\
            --find-links {q(str(dist))} $requirements >"$work/pip.log" 2>&1 \\
          || {{ cat "$work/pip.log"; echo "CHECK-FAILED: pip cannot resolve the install"; exit 1; }}
        grep -v '^WARNING: Location' "$work/pip.log" || true   # this machine's pip.conf noise
        timeout 900 {q(str(UV))} pip install -q --compile-bytecode \\
            --python {q(str(venv / "bin" / "python"))} --find-links {q(str(dist))} $requirements \\
          || {{ echo "CHECK-FAILED: the install failed"; exit 1; }}
        echo "T-INSTALL-END $(stamp)"
        timeout 120 python - <<'EOF'
        import ctypes, pathlib, subprocess, sys
        from importlib import metadata
        import tnt_comm_gloo, tnt_core, tarantella, tnt_cli
        from tnt_comm_gloo import _gloo
        venv = pathlib.Path(sys.prefix)
        for mod in (tnt_comm_gloo, tnt_core, tarantella, tnt_cli, _gloo):
            assert pathlib.Path(mod.__file__).is_relative_to(venv), f"{{mod.__name__}} from {{mod.__file__}}"
        dist = metadata.distribution("tnt-comm-gloo")
        tags = [l for l in dist.read_text("WHEEL").splitlines() if l.startswith("Tag:")]
        assert any("manylinux_2_" in t for t in tags), tags
        assert any(str(f).endswith("licenses/gloo/LICENSE") for f in dist.files), "Gloo's license"
        needed = subprocess.run(["ldd", _gloo.__file__], capture_output=True, text=True, timeout=30).stdout
        assert "gloo" not in needed.replace(_gloo.__file__, "") and "not found" not in needed, needed
        for name in ("libgloo.so.0", "libgloo.so"):
            try:
                ctypes.CDLL(name)
            except OSError:
                continue
            raise AssertionError(f"{{name}} loads")
        print("WHEEL-OK", tags, "| ldd:", " ".join(l.split()[0] for l in needed.splitlines()))
        EOF
        timeout 60 tnt backends
        echo "T-RUN-START $(stamp)"
        timeout 600 tnt run -n 2 --backend gloo -- examples/quickstart/lenet5.py --epochs 1 \\
            --compare-serial --verbose 2 2>&1 | while IFS= read -r line; do echo "$(stamp) $line"; done
        echo "T-RUN-END $(stamp)"
        timeout 600 python -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \\
            packages/tnt-comm-gloo/tests/test_conformance_gloo.py::TestGlooConformance -k np2
        echo "T-CONFORMANCE-END $(stamp)"
        """)
    try:
        out, seconds = _run_namespaced(script, tmp_path, timeout=1700)
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # ~1.5 GB (TensorFlow); pytest keeps 3 runs' tmp

    stamps = {m.group(1): float(m.group(2)) for m in re.finditer(r"^T-([A-Z-]+) ([0-9.]+)$", out, re.M)}
    needed = {"INSTALL-START", "INSTALL-END", "RUN-START", "RUN-END", "CONFORMANCE-END"}
    assert needed <= set(stamps), out[-8000:]
    assert "WHEEL-OK" in out, out[-8000:]
    assert re.search(r"^gloo +priority", out, re.M), "tnt backends does not list gloo:\n" + out[-8000:]
    # the first line Keras prints at the end of an epoch (verbose=2): "N/N - Ns - ... accuracy"
    epoch = re.search(r"^([0-9.]+) \d+/\d+ - .*accuracy", out, re.M)
    distributed = re.search(r"distributed \(2 ranks\): test accuracy ([0-9.]+)", out)
    serial = re.search(r"serial \(1 process\): +test accuracy ([0-9.]+)", out)
    diff = re.search(r"distributed vs serial: ([0-9.e+-]+)", out)
    assert epoch and distributed and serial and diff, out[-8000:]
    assert distributed.group(1) == serial.group(1), out[-4000:]
    assert float(diff.group(1)) <= 1e-5, out[-4000:]
    assert out.count("LeNet-5 on") == 1, "the master prints, the other rank is silent"
    passed = re.search(r"^\d+ passed", out, re.M)
    assert passed and not re.search(r"\d+ (failed|error)", out), out[-8000:]

    start = stamps["INSTALL-START"]
    shown = re.compile(r"^(WHEEL-OK|gloo +priority|[0-9.]+ (Epoch|\d+/\d+ - |LeNet-5"
                       r"|distributed \(|serial \(|largest))")
    print("\n".join(line for line in out.splitlines() if shown.search(line)))
    print(f"pip install: {stamps['INSTALL-END'] - start:.1f} s; "
          f"pip install start to first trained epoch: {float(epoch.group(1)) - start:.1f} s; "
          f"tnt run (2 ranks + serial): {stamps['RUN-END'] - stamps['RUN-START']:.1f} s; "
          f"conformance ({passed.group(0)}): {stamps['CONFORMANCE-END'] - stamps['RUN-END']:.1f} s; "
          f"total {seconds:.1f} s; accuracy distributed {distributed.group(1)} serial {serial.group(1)}, "
          f"weights differ by {diff.group(1)}")


def test_sdist_without_gloo_fails_with_one_line_naming_the_wheel(dist: Path, tmp_path: Path):
    sdist = next(dist.glob("tnt_comm_gloo-*.tar.gz"))
    tools = ROOT / "build" / "wheel-tools" / "bin"  # build/nanobind/scikit-build-core, from build-wheels.sh
    q = shlex.quote
    script = _hide_prelude(tmp_path, hide_build_tools=False) + textwrap.dedent(f"""\
        export PATH={q(str(tools))}:$PATH
        if timeout 300 pip wheel --no-deps --no-build-isolation -w {q(str(tmp_path / "out"))} \\
             {q(str(sdist))} >{q(str(tmp_path / "log"))} 2>&1; then
          echo "CHECK-FAILED: the sdist built without Gloo"; exit 1
        fi
        cat {q(str(tmp_path / "log"))}
        """)
    out, _ = _run_namespaced(script, tmp_path, timeout=400)
    lines = [line for line in out.splitlines() if "Gloo not found:" in line]
    assert lines, out[-6000:]
    line = lines[0]
    for must in ("tnt-comm-gloo wheel", "libgloo-dev", "CMAKE_PREFIX_PATH"):
        assert must in line, line
    assert "Gloo not found (see the line above)" in out, out[-6000:]
    assert line.strip() in (ROOT / "docs" / "installation.md").read_text(), "docs/installation.md quotes it"
