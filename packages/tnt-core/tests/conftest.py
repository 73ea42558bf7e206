import pytest

import tnt_core


@pytest.fixture
def clean_runtime(monkeypatch):
    """A process without a launcher environment and without a started runtime."""
    import os

    for name in list(os.environ):
        if name.startswith("TNT_"):
            monkeypatch.delenv(name)
    tnt_core.shutdown()
    tnt_core.reset_plugin_manager()
    yield monkeypatch
    tnt_core.shutdown()
    tnt_core.reset_plugin_manager()
