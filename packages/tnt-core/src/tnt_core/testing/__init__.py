"""Test support for backends and frameworks: real multi-process launches and the backend
conformance suite (``tnt_core.testing.suite.BackendConformance``, which needs pytest).
"""

from .conformance import CASE_NAMES
from .launch import LaunchResult, RankResult, launch_ranks, rank_env

__all__ = ["CASE_NAMES", "LaunchResult", "RankResult", "launch_ranks", "rank_env"]
