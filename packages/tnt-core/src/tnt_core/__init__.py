"""tnt-core: the contracts Tarantella-NT's packages and third-party plugins meet through.

Knows no deep-learning framework. Public names only come from here (and from the
``tnt_core.testing`` sub-package); the modules behind them are private (``_backend``,
``_runtime``, ...) and may change without notice. A test keeps every other package, the
tests, benchmarks and examples on these names.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ._addresses import can_bind, is_loopback
from ._backend import (
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
from ._backend_choice import list_backends, select_backend, unknown_backend_hint
from ._comm_thread import CommThread, FutureHandle
from ._config import Config
from ._elastic import (
    FINISHED_KEY,
    READY_KEY,
    RESTART_ALL_KEY,
    Departure,
    Membership,
    latest_generation,
    publish_membership,
    read_membership,
)
from ._errors import (
    CollectiveMismatchError,
    CommError,
    ConfigError,
    HandshakeError,
    PluginError,
    ShardingError,
    TntError,
    UnsupportedOperationError,
)
from ._fusion import (
    BUFFER_ALIGNMENT,
    Bucket,
    BucketPlan,
    FusedAllreducer,
    TensorSpec,
    plan_buckets,
)
from ._handshake import HANDSHAKE_TIMEOUT_S, Handshake
from ._installed_settings import installed_settings, read_setting
from ._launch_env import MpiLaunch, detect_mpi_launch
from ._lifecycle import (
    get_master_rank,
    get_rank,
    get_size,
    init,
    is_initialized,
    is_master_rank,
    membership_changed,
    rejoin,
    shutdown,
)
from ._local_backend import LocalBackend
from ._markers import ENTRY_POINT_GROUP, hookimpl, hookspec
from ._native import NativeComm, native_comm
from ._peer_failure import PEER_FAILURE_EXIT_CODE
from ._plugins import get_plugin_manager, reset_plugin_manager
from ._priority import carry_priority
from ._rendezvous import (
    StoreClient,
    StoreServer,
    address_towards,
    connect_store,
    reachable_address,
)
from ._runtime import Runtime
from ._setting_registry import InstalledSettings, SettingsRegistry
from ._settings import (
    VARIABLES,
    SettingGroup,
    Variable,
    bad_input,
    directory_problem,
    interface_problem,
    local_address_problem,
)
from ._sharding import (
    ShardContext,
    micro_batch_offset,
    micro_batch_size,
    micro_batch_sizes,
    micro_batch_slice,
)
from ._stall_inspector import NOT_ARRIVED_KEY
from ._stall_ledger import report_position
from ._timeline import Timeline, timeline_path
from ._watched_backend import WatchedBackend

try:
    __version__ = version("tnt-core")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    # the runtime of a rank
    "Runtime",
    "get_master_rank",
    "get_rank",
    "get_size",
    "init",
    "is_initialized",
    "is_master_rank",
    "list_backends",
    "select_backend",
    "shutdown",
    # an elastic job's membership (tnt run --min-np/--max-restarts)
    "FINISHED_KEY",
    "READY_KEY",
    "RESTART_ALL_KEY",
    "Departure",
    "Membership",
    "latest_generation",
    "membership_changed",
    "publish_membership",
    "read_membership",
    "rejoin",
    # plugins
    "ENTRY_POINT_GROUP",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "reset_plugin_manager",
    # the CommBackend contract, and what backends build on
    "REDUCE_OPS",
    "SUPPORTED_DTYPES",
    "BackendSpec",
    "CommBackend",
    "CommThread",
    "CompletedHandle",
    "FutureHandle",
    "Handle",
    "LocalBackend",
    "WatchedBackend",
    "check_buffer",
    "check_op",
    "check_peer",
    "check_split_ranks",
    "check_timeout",
    "wait_all",
    # the native hand-off
    "NativeComm",
    "native_comm",
    # errors
    "CollectiveMismatchError",
    "CommError",
    "ConfigError",
    "HandshakeError",
    "PluginError",
    "ShardingError",
    "TntError",
    "UnsupportedOperationError",
    # settings
    "VARIABLES",
    "Config",
    "InstalledSettings",
    "SettingGroup",
    "SettingsRegistry",
    "Variable",
    "bad_input",
    "directory_problem",
    "installed_settings",
    "interface_problem",
    "local_address_problem",
    "read_setting",
    # the launcher contract: the store, the handshake, how a rank's end is reported
    "HANDSHAKE_TIMEOUT_S",
    "NOT_ARRIVED_KEY",
    "PEER_FAILURE_EXIT_CODE",
    "Handshake",
    "MpiLaunch",
    "StoreClient",
    "StoreServer",
    "address_towards",
    "can_bind",
    "carry_priority",
    "connect_store",
    "detect_mpi_launch",
    "is_loopback",
    "reachable_address",
    # tensor fusion, sharding, the stall inspector's position, the timeline
    "BUFFER_ALIGNMENT",
    "Bucket",
    "BucketPlan",
    "FusedAllreducer",
    "TensorSpec",
    "plan_buckets",
    "ShardContext",
    "micro_batch_offset",
    "micro_batch_size",
    "micro_batch_sizes",
    "micro_batch_slice",
    "report_position",
    "Timeline",
    "timeline_path",
    "unknown_backend_hint",
    "__version__",
]

# Errors name their public home in tracebacks (``tnt_core.CommError: ...``), not the
# private module that defines them.
for _error in (CollectiveMismatchError, CommError, ConfigError, HandshakeError, PluginError,
               ShardingError, TntError, UnsupportedOperationError):
    _error.__module__ = __name__
del _error
