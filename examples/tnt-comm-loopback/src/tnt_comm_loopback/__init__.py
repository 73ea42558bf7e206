"""Example third-party Tarantella-NT backend: every collective through rank 0 over loopback."""

from .backend import LoopbackBackend

__all__ = ["LoopbackBackend"]
