"""canzona's runtime: execute a schedule file under torch.distributed every optimizer step.

Never imports the planner, typer or ortools: it reads the schedule file and nothing else.
"""

from canzona.runtime.baselines import DpScOptimizer, TpScOptimizer
from canzona.runtime.optimizer import CanzonaOptimizer
from canzona.runtime.optimizers import Hyperparameters
from canzona.runtime.schedule import ScheduleMismatchError, load_schedule

__all__ = [
    "CanzonaOptimizer",
    "DpScOptimizer",
    "Hyperparameters",
    "ScheduleMismatchError",
    "TpScOptimizer",
    "load_schedule",
]
