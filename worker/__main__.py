"""``python -m worker``: see :mod:`worker.engine_main`."""

import sys

from worker.engine_main import main

sys.exit(main())
