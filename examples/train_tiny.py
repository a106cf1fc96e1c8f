"""Train the tiny Qwen3-style model under DP x TP with canzona, on synthetic data.

    canzona plan --model examples/tiny_qwen3.yaml --tp 2 --dp 2 --bucket-size 20000 \\
        --group-mb 0.03 -o /tmp/tiny.yaml
    torchrun --nproc-per-node 4 examples/train_tiny.py --tp 2 --dp 2 --schedule /tmp/tiny.yaml

Global rank = dp_rank * tp + tp_rank. Prints the DP-mean loss and the optimizer step time;
`--strategy dp-sc|tp-sc` runs a baseline with the same math instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_qwen3 import TinyConfig, TinyQwen3, init_full_state, shard_state, synthetic_batch  # noqa: E402

from canzona.runtime import CanzonaOptimizer, DpScOptimizer, TpScOptimizer, load_schedule, make_groups  # noqa: E402
from canzona.runtime.schedule import DTYPES  # noqa: E402

STRATEGIES = {"canzona": CanzonaOptimizer, "dp-sc": DpScOptimizer, "tp-sc": TpScOptimizer}
TIMEOUT = timedelta(seconds=60)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--schedule", required=True, help="schedule file from `canzona plan`")
    parser.add_argument("--config", default=str(Path(__file__).with_name("tiny_qwen3.json")), help="model shapes (HF config)")
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="canzona")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="sequences per DP rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--adamw-lr", type=float, default=3e-3)
    return parser.parse_args(argv)



def main(argv: list[str] | None = None) -> None:
    """Train and report."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    if dist.get_world_size() != args.dp * args.tp:
        raise SystemExit(f"world size {dist.get_world_size()} is not dp {args.dp} x tp {args.tp}")
    dp_group, tp_group = make_groups(args.dp, args.tp, TIMEOUT)
    dp_rank, tp_rank = divmod(dist.get_rank(), args.tp)
    cfg = TinyConfig.from_hf(json.loads(Path(args.config).read_text()))
    dtype = DTYPES[load_schedule(args.schedule).params[0].dtype]
    model = TinyQwen3(cfg, tp_group).to(dtype)
    model.load_state_dict(shard_state(init_full_state(cfg), args.tp, tp_rank))
    optimizer = STRATEGIES[args.strategy](model.named_parameters(), args.schedule, dp_group=dp_group, tp_group=tp_group,
                                          lr=args.lr, adamw_lr=args.adamw_lr)
    times, first = [], None
    for step in range(args.steps):
        loss = model(synthetic_batch(cfg, args.batch, args.seq, seed=step * args.dp + dp_rank))
        loss.backward()
        started = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - started)
        optimizer.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, group=dp_group)
        mean = float(mean) / args.dp
        first = mean if first is None else first
        if dist.get_rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean:.4f}  optimizer step {times[-1] * 1e3:.1f} ms", flush=True)
    if dist.get_rank() == 0:
        print(f"{args.strategy}: loss {first:.4f} -> {mean:.4f}; median step {statistics.median(times) * 1e3:.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
