"""The hook implementations tnt-core finds through the ``tnt`` entry point: the backend,
and the one setting of its own (``TNT_LOOPBACK_PORT``)."""

from tnt_core import BackendSpec, SettingGroup, hookimpl

# Settings of a plugin start with a prefix of its own; tnt run checks their values before
# any rank starts, and `tnt settings` and the docs list them.
SETTINGS = SettingGroup("loopback", "the `loopback` example backend (tnt-comm-loopback)",
                        prefix="TNT_LOOPBACK_")
TNT_LOOPBACK_PORT = SETTINGS.declare(
    "TNT_LOOPBACK_PORT", "int", 0, "TCP port rank 0 listens on for the other ranks (0: a free one)",
    minimum=0, maximum=65535)


@hookimpl
def tnt_register_settings(registry):
    registry.add(SETTINGS)


def _factory(config):
    from .backend import LoopbackBackend  # imported only when the backend is chosen

    return LoopbackBackend(config)


@hookimpl
def tnt_comm_backends():
    return [
        BackendSpec(
            name="loopback",
            factory=_factory,
            priority=10,
            available=lambda config: config.size > 1 and config.rendezvous is not None
            and not config.rendezvous.startswith("file://"),
            description="example plugin: collectives through rank 0 over loopback TCP",
        )
    ]
