"""``python -m tnt_cli run ...`` is ``tnt run ...``."""

import sys

from .main import main

sys.exit(main())
