"""A backend shipped by a third party: a package whose only content is a backend class
and a ``tnt`` entry point, installed into the venv, found and selected by name."""

import importlib.util
import subprocess
import sys
import textwrap
import uuid

import pytest

PLUGIN_SOURCE = '''
import numpy as np
from tnt_core import BackendSpec, CommBackend, CompletedHandle, check_buffer, check_op, hookimpl


class MirrorBackend(CommBackend):
    """One rank; 'reduces' by doubling, so a test can tell it really ran."""

    name = "{name}"

    def __init__(self, config):
        self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1

    def allreduce_async(self, buf, op="sum"):
        check_op(op)
        check_buffer(buf, "allreduce")
        buf *= 2
        return CompletedHandle(buf)

    def broadcast(self, buf, root=0):
        return buf

    def allgather(self, buf):
        return np.stack([buf])

    def barrier(self):
        pass

    def close(self):
        pass


@hookimpl
def tnt_comm_backends():
    return [BackendSpec(name="{name}", factory=MirrorBackend, priority=-5)]
'''

PYPROJECT = '''
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.0.1"
dependencies = ["tnt-core"]

[project.entry-points.tnt]
{name} = "{module}"
'''


@pytest.fixture
def installed_plugin(tmp_path):
    tag = uuid.uuid4().hex[:8]
    name, module, dist = f"mirror{tag}", f"tnt_mirror_{tag}", f"tnt-mirror-{tag}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PLUGIN_SOURCE.format(name=name)))
    (tmp_path / "pyproject.toml").write_text(PYPROJECT.format(dist=dist, name=name, module=module))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", str(tmp_path)]
    if importlib.util.find_spec("setuptools"):  # offline-friendly; else pip fetches it
        cmd.insert(4, "--no-build-isolation")
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", dist],
                       check=True, timeout=120, capture_output=True)


def run_python(code, **env):
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, timeout=120)


def test_installed_backend_is_listed_and_selected_by_name(installed_plugin):
    name = installed_plugin
    code = textwrap.dedent("""
        import numpy as np, tnt_core
        print(",".join(s.name for s in tnt_core.list_backends()))
        rt = tnt_core.init()
        buf = np.ones(3, np.float32)
        rt.backend.allreduce(buf)
        print(rt.backend.name, buf.tolist())
    """)
    listed = run_python(code)
    assert listed.returncode == 0, listed.stderr
    names, default = listed.stdout.splitlines()
    assert name in names.split(",")
    assert default == "local [1.0, 1.0, 1.0]", "priority -5 must not beat local"

    chosen = run_python(code, TNT_BACKEND=name)
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.splitlines()[1] == f"{name} [2.0, 2.0, 2.0]"


def test_a_backend_never_installed_is_unknown():
    gone = run_python("import tnt_core; tnt_core.init()", TNT_BACKEND="mirror-never-installed")
    assert gone.returncode != 0
    assert "unknown backend 'mirror-never-installed'" in gone.stderr
