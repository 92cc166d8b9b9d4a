"""Import paths for the memory tests, robust to pytest's import mode.

- ``memtest_helpers`` (shared factories) lives next to this file; under
  ``--import-mode=importlib`` test directories are not on ``sys.path``, so add this one.
- Under the default "prepend" mode pytest puts ``tests/`` on ``sys.path``, where
  ``tests/memory/`` (no ``__init__``) would shadow the real ``memory`` package as an empty
  namespace package: put the repository root first and drop any such shadow.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for path in (str(HERE), str(ROOT)):
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)
for name in [m for m in sys.modules if m == "memory" or m.startswith("memory.")]:
    if getattr(sys.modules[name], "__file__", None) is None:
        del sys.modules[name]
