"""The ``tarantella`` logger (a child of tnt-core's, so ``TNT_LOG_LEVEL`` applies)."""

import logging

logger = logging.getLogger("tnt.keras")
