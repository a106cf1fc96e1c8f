"""Make this folder's helper module (`cli_run`) importable in any import mode."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
