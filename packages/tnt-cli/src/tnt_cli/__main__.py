"""``python -m tnt_cli run ...`` is ``tnt run ...``."""

import sys

from ._entry import main  # first: its Ctrl+C handler

sys.exit(main())
