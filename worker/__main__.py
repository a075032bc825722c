"""``python -m worker``: see :mod:`worker.engine_main`."""

import os
import sys

# NOTE: before torch is imported (it reads this once): large tensors in 2 MiB pages. A decode
# step streams every weight from memory; with 4 KiB pages that is a TLB miss every 4 KiB
# (SmolLM2 float32, c = 1: 35.7 -> 32.5 ms per decode forward). Set it to 0 to keep 4 KiB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from worker.engine_main import main  # noqa: E402

sys.exit(main())
