"""Make this folder's helper modules (`rt_harness`, `rt_oracle`) importable in any import mode."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
