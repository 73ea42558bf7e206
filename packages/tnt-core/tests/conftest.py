import pytest

import tnt_core
from tnt_core.testing import STORE_PLUGIN, enable_store_backend

# the test-only store backend, for this process and every rank the tests start
enable_store_backend()


@pytest.fixture
def clean_runtime(monkeypatch):
    """A process without a launcher environment and without a started runtime (but with
    the test-only store backend)."""
    import os

    for name in list(os.environ):
        if name.startswith("TNT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TNT_PLUGINS", STORE_PLUGIN)
    tnt_core.shutdown()
    tnt_core.reset_plugin_manager()
    yield monkeypatch
    tnt_core.shutdown()
    tnt_core.reset_plugin_manager()
