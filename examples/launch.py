"""What every example does first under torchrun: join the process group on the backend the
machine has, NCCL with one GPU per process (`LOCAL_RANK`), else gloo on the CPU."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(timeout: timedelta) -> torch.device:
    """Initialise torch.distributed from torchrun's environment; the device this rank uses."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # before any NCCL collective: canzona's checks stage objects on it
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        return device
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")
