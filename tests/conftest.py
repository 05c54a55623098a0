"""Shared pytest setup: the repository root is importable even when the project
is not installed (``ectransfer``, ``services`` and the generated ``epd`` stubs)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
