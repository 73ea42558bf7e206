"""Logging of the ``tnt`` logger: rank-prefixed, quiet on non-master ranks.

Non-master ranks show only errors unless ``TNT_LOG_ALL`` (``--log-on-all-devices``):
with N ranks, N copies of every warning would bury the one that matters. A record logged
with ``extra={"tnt_any_rank": True}`` passes on every rank: it is said by one rank only,
whichever that is (the stall inspector's report).
"""

from __future__ import annotations

import logging

from ._config import Config

__all__ = ["logger", "configure_logging"]

logger = logging.getLogger("tnt")
_HANDLER_ATTR = "_tnt_handler"


class _RankFilter(logging.Filter):
    def __init__(self, quiet: bool) -> None:
        super().__init__()
        self._quiet = quiet

    def filter(self, record: logging.LogRecord) -> bool:
        return (not self._quiet or record.levelno >= logging.ERROR
                or getattr(record, "tnt_any_rank", False))


def configure_logging(config: Config, rank: int | None = None) -> None:
    """Install (once) a stderr handler on the ``tnt`` logger for this rank."""
    rank = config.rank if rank is None else rank
    for handler in list(logger.handlers):
        if getattr(handler, _HANDLER_ATTR, False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler()
    setattr(handler, _HANDLER_ATTR, True)
    handler.setFormatter(logging.Formatter(f"[tnt {rank}] %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_RankFilter(quiet=rank != 0 and not config.log_all))
    logger.addHandler(handler)
    logger.setLevel(config.log_level)
    logger.propagate = False
