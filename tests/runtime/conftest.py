"""Make this folder's helper modules (`rt_harness`, `rt_oracle`) importable in any import mode,
and run the single-process oracles single-threaded, as the ranks run (`rt_harness._worker`): a
CPU reduction's summation order, and with it the last bits an AdamW step on a tiny gradient
amplifies, then does not depend on how many cores the machine has or on which test ran first."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)
