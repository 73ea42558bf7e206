"""Plugin modules loaded through TNT_PLUGINS by test_plugins.py (no packaging needed)."""

from tnt_core import BackendSpec, LocalBackend, hookimpl


class EchoBackend(LocalBackend):
    name = "echo"


@hookimpl
def tnt_comm_backends():
    return [BackendSpec(name="echo", factory=EchoBackend, priority=5, description="test")]


@hookimpl
def tnt_shard_data(data, context):
    return ("sharded", data, context.rank) if isinstance(data, list) else None
