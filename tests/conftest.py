"""The repository-level tests' helpers (``examples_site``) import by name: pytest's
importlib mode puts no test folder on ``sys.path``."""

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
