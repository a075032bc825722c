"""Print the project's dependencies from pyproject.toml, minus the ones named on the command line.

Used by the Dockerfile so that each image installs exactly what pyproject.toml lists (no second
list to drift from it), without what that image does not need::

    python deploy/requirements.py torch triton numpy > requirements.txt
"""

import re
import sys
import tomllib
from pathlib import Path

skip = set(sys.argv[1:])
pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
print("\n".join(d for d in deps if re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0] not in skip))
