"""`bench/` is not an installed package (setuptools ships server, engine, memory only), so its
tests import it from the repository root, as `python -m bench.run` does."""

from __future__ import annotations

import sys

from tests.conftest import ROOT

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
