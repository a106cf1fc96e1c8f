"""Make this folder's test modules importable by each other in any import mode (the
free-order tests reuse `test_dp`'s instance strategies and helpers)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
