"""tnt-core: the contracts Tarantella-NT's packages and third-party plugins meet through.

Knows no deep-learning framework. Public names only come from here.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ._markers import ENTRY_POINT_GROUP, PROJECT_NAME, hookimpl, hookspec
from .addresses import can_bind, is_loopback
from .backend import (
    REDUCE_OPS,
    SUPPORTED_DTYPES,
    BackendSpec,
    CommBackend,
    CompletedHandle,
    Handle,
    check_buffer,
    check_op,
    check_peer,
    check_split_ranks,
    check_timeout,
    wait_all,
)
from .comm_thread import CommThread, FutureHandle
from .config import (
    DEFAULT_FUSION_THRESHOLD_KB,
    DEFAULT_TIMEOUT_S,
    Config,
    env_number,
    parse_bool,
)
from .errors import (
    CollectiveMismatchError,
    CommError,
    ConfigError,
    HandshakeError,
    PluginError,
    ShardingError,
    TntError,
    UnsupportedOperationError,
)
from .fusion import (
    BUFFER_ALIGNMENT,
    Bucket,
    BucketPlan,
    FusedAllreducer,
    TensorSpec,
    plan_buckets,
)
from .handshake import HANDSHAKE_TIMEOUT_S, Handshake
from .launch_env import MpiLaunch, detect_mpi_launch, expand_tasks_per_node
from .local_backend import LocalBackend
from .native import NativeComm, native_comm
from .peer_failure import PEER_FAILURE_EXIT_CODE
from .plugins import get_plugin_manager, reset_plugin_manager
from .rendezvous import (
    StoreClient,
    StoreServer,
    address_towards,
    connect_store,
    reachable_address,
)
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
    unknown_backend_hint,
)
from .setting_registry import InstalledSettings, SettingsRegistry, installed_settings, read_setting
from .settings import VARIABLES, SettingGroup, Variable
from .sharding import (
    ShardContext,
    micro_batch_offset,
    micro_batch_size,
    micro_batch_sizes,
    micro_batch_slice,
)
from .stall import WatchedBackend, report_position
from .timeline import Timeline, timeline_path

try:
    __version__ = version("tnt-core")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "NativeComm",
    "native_comm",
    "BUFFER_ALIGNMENT",
    "DEFAULT_FUSION_THRESHOLD_KB",
    "DEFAULT_TIMEOUT_S",
    "HANDSHAKE_TIMEOUT_S",
    "PEER_FAILURE_EXIT_CODE",
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "REDUCE_OPS",
    "SUPPORTED_DTYPES",
    "BackendSpec",
    "Bucket",
    "BucketPlan",
    "CommBackend",
    "CollectiveMismatchError",
    "CommError",
    "CommThread",
    "CompletedHandle",
    "Config",
    "ConfigError",
    "FusedAllreducer",
    "FutureHandle",
    "Handle",
    "Handshake",
    "HandshakeError",
    "InstalledSettings",
    "LocalBackend",
    "MpiLaunch",
    "PluginError",
    "Runtime",
    "SettingGroup",
    "SettingsRegistry",
    "ShardContext",
    "ShardingError",
    "StoreClient",
    "StoreServer",
    "TensorSpec",
    "Timeline",
    "TntError",
    "UnsupportedOperationError",
    "VARIABLES",
    "Variable",
    "WatchedBackend",
    "address_towards",
    "can_bind",
    "check_buffer",
    "check_op",
    "check_peer",
    "check_split_ranks",
    "check_timeout",
    "connect_store",
    "detect_mpi_launch",
    "env_number",
    "expand_tasks_per_node",
    "get_master_rank",
    "get_plugin_manager",
    "get_rank",
    "get_size",
    "hookimpl",
    "hookspec",
    "init",
    "installed_settings",
    "is_initialized",
    "is_loopback",
    "is_master_rank",
    "list_backends",
    "micro_batch_offset",
    "micro_batch_size",
    "micro_batch_sizes",
    "micro_batch_slice",
    "parse_bool",
    "plan_buckets",
    "reachable_address",
    "read_setting",
    "report_position",
    "reset_plugin_manager",
    "select_backend",
    "settings",
    "shutdown",
    "timeline_path",
    "unknown_backend_hint",
    "wait_all",
    "__version__",
]
