"""canzona's runtime: execute a schedule file under torch.distributed every optimizer step.

Never imports the planner, typer or ortools: it reads the schedule file and nothing else.
"""

from canzona.runtime.faults import CheckpointError, CollectiveError, StepFailedError
from canzona.runtime.fsdp.optimizer import FsdpOptimizer
from canzona.runtime.optimizer import CanzonaOptimizer
from canzona.runtime.process_groups import make_groups
from canzona.runtime.rules.optimizers import Hyperparameters
from canzona.runtime.schedule import ScheduleMismatchError, load_schedule
from canzona.runtime.state.checkpoint import load_checkpoint, merge_state_dicts, save_checkpoint
from canzona.runtime.state.stateful import DcpState
from canzona.runtime.tools.baselines import DpScOptimizer, TpScOptimizer

__all__ = [
    "CanzonaOptimizer",
    "CheckpointError",
    "CollectiveError",
    "DcpState",
    "DpScOptimizer",
    "FsdpOptimizer",
    "Hyperparameters",
    "ScheduleMismatchError",
    "StepFailedError",
    "TpScOptimizer",
    "load_checkpoint",
    "load_schedule",
    "make_groups",
    "merge_state_dicts",
    "save_checkpoint",
]
