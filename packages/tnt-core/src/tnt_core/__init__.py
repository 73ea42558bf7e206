"""tnt-core: the contracts Tarantella-NT's packages and third-party plugins meet through.

Knows no deep-learning framework. Public names only come from here.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ._markers import ENTRY_POINT_GROUP, PROJECT_NAME, hookimpl, hookspec
from .backend import (
    REDUCE_OPS,
    SUPPORTED_DTYPES,
    BackendSpec,
    CommBackend,
    CompletedHandle,
    Handle,
    check_buffer,
    check_op,
    wait_all,
)
from .comm_thread import CommThread, FutureHandle
from .config import DEFAULT_FUSION_THRESHOLD_KB, DEFAULT_TIMEOUT_S, Config, env_number
from .errors import CommError, ConfigError, PluginError, ShardingError, TntError
from .fusion import Bucket, BucketPlan, FusedAllreducer, TensorSpec, plan_buckets
from .local_backend import LocalBackend
from .plugins import get_plugin_manager, reset_plugin_manager
from .rendezvous import StoreClient, StoreServer, address_towards, connect_store
from .runtime import (
    Runtime,
    get_master_rank,
    get_rank,
    get_size,
    init,
    is_initialized,
    is_master_rank,
    list_backends,
    select_backend,
    shutdown,
)
from .timeline import Timeline, timeline_path
from .sharding import (
    ShardContext,
    micro_batch_offset,
    micro_batch_size,
    micro_batch_sizes,
    micro_batch_slice,
)

try:
    __version__ = version("tnt-core")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_FUSION_THRESHOLD_KB",
    "DEFAULT_TIMEOUT_S",
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "REDUCE_OPS",
    "SUPPORTED_DTYPES",
    "BackendSpec",
    "Bucket",
    "BucketPlan",
    "CommBackend",
    "CommError",
    "CommThread",
    "CompletedHandle",
    "Config",
    "ConfigError",
    "FusedAllreducer",
    "FutureHandle",
    "Handle",
    "LocalBackend",
    "PluginError",
    "Runtime",
    "ShardContext",
    "ShardingError",
    "StoreClient",
    "StoreServer",
    "TensorSpec",
    "Timeline",
    "TntError",
    "address_towards",
    "check_buffer",
    "check_op",
    "connect_store",
    "env_number",
    "get_master_rank",
    "get_plugin_manager",
    "get_rank",
    "get_size",
    "hookimpl",
    "hookspec",
    "init",
    "is_initialized",
    "is_master_rank",
    "list_backends",
    "micro_batch_offset",
    "micro_batch_size",
    "micro_batch_sizes",
    "micro_batch_slice",
    "plan_buckets",
    "reset_plugin_manager",
    "select_backend",
    "shutdown",
    "timeline_path",
    "wait_all",
    "__version__",
]
