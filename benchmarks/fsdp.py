"""FSDP2 benchmark: optimizer step latency of FSDP2 + canzona (`FsdpOptimizer`) vs FSDP2 + a
per-rank redundant Muon (every rank gathers every matrix with `full_tensor()` and runs
Newton-Schulz on all of them, the usual way Muon is bolted onto FSDP) vs FSDP2 + AdamW
(`torch.optim.AdamW`, the element-wise floor), on CPU ranks (gloo).

Run:  python benchmarks/fsdp.py            (4 ranks, a tiny transformers Qwen3, about 2 minutes)
      python benchmarks/fsdp.py --quick    (fewer steps)
      python benchmarks/fsdp.py --ranks 2

All three optimizers step the same FSDP2 model from the same gradients, interleaved (canzona,
redundant, AdamW, canzona, ...) so background load hits them alike. A step's latency is the
slowest rank's `step()` time (ranks start together after a barrier); the table shows medians
over the timed steps after warm-up, ratios strategy / canzona, and the largest optimizer state
of a rank. The schedule comes from one planner call on the model's description.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from canzona.planner.compile import compile_schedule
from canzona.planner.fsdp import make_fsdp_plan
from canzona.planner.plan import PlanRequest
from canzona.planner.sources.load import model_from_data
from canzona.planner.spec import ModelOptions
from canzona.runtime.fsdp.optimizer import FsdpOptimizer
from canzona.runtime.rules.optimizers import Hyperparameters, adamw_, init_matrix_state, make_rule, matrix_update
from canzona.runtime.tools.describe import describe_module
from canzona.schedules.format import Schedule
from canzona.schedules.geometry import fsdp_rows

CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=2048,
    tie_word_embeddings=False,
)
HP = {"lr": 0.02, "adamw_lr": 1e-3}
GROUP_BYTES = 1 << 20  # per host and micro-group: several groups, so the next gather is in flight
TIMEOUT = timedelta(seconds=300)


def make_model() -> torch.nn.Module:
    """The benchmark's Qwen3 (fp32, seeded)."""
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG))


def plan(ranks: int) -> Schedule:
    """The FSDP schedule of the model over `ranks` FSDP2 ranks (one planner call on its description)."""
    with torch.device("meta"):
        description = describe_module(make_model())
    spec = model_from_data(
        description.to_data(),
        description.name,
        "py:benchmarks/fsdp.py:make_model",
        description.sha256,
        1,
        ModelOptions(),
    )
    return compile_schedule(
        make_fsdp_plan(spec, PlanRequest(spec.source, 1, ranks, sharding="fsdp", group_bytes=GROUP_BYTES))
    )


class RedundantMuon:
    """Every rank all-gathers every matrix's gradient (`full_tensor`), runs the matrix optimizer
    on all of them and applies its own rows; AdamW on the local shards."""

    def __init__(self, model: torch.nn.Module, schedule: Schedule) -> None:
        self.hp = Hyperparameters(**HP).resolved(schedule.request.optimizer)
        self.rule = make_rule(schedule.request.optimizer.name, self.hp)
        entries = {e.name: e for e in schedule.params}
        self.params = [(name, p, entries[name]) for name, p in model.named_parameters()]
        self.state: dict[str, Any] = {}
        self.steps = 0
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        for name, param, entry in self.params:
            local = param.to_local()
            if entry.optimizer == "matrix":
                if name not in self.state:
                    self.state[name] = init_matrix_state(self.rule, tuple(entry.shape), entry.row_blocks, local.device)
                update = matrix_update(
                    self.rule, self.state[name], param.grad.full_tensor(), entry.row_blocks, self.steps
                )
                start, stop = fsdp_rows(entry.shape[0], self.world)[self.rank]
                local.add_(update[start:stop], alpha=-self.hp.lr)
            elif local.numel():
                if name not in self.state:
                    self.state[name] = [torch.zeros(local.numel(), device=local.device) for _ in range(2)]
                exp_avg, exp_avg_sq = self.state[name]
                adamw_(local.view(-1), param.grad.to_local().reshape(-1), exp_avg, exp_avg_sq, self.steps, self.hp)


def _tensor_bytes(value: Any) -> int:
    """fp32 bytes of every local tensor in a (nested) state value."""
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.numel() * local.element_size() if local.dim() else 0
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _state_bytes(optimizer: Any) -> int:
    """This rank's optimizer state (matrix states, moments, main copies)."""
    return _tensor_bytes(list(optimizer.state.values()))


def _rank(rank: int, ranks: int, init: str, schedule: Schedule, warmup: int, steps: int, out: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=ranks, timeout=TIMEOUT)
    model = make_model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizers = {
        "canzona": FsdpOptimizer(model.named_parameters(), schedule, timeout=TIMEOUT, **HP),
        "redundant": RedundantMuon(model, schedule),
        "adamw": torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False),
    }
    times: dict[str, list[float]] = {name: [] for name in [*optimizers, "forward+backward"]}
    for step in range(warmup + steps):
        tokens = torch.randint(
            0, CONFIG["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(step * 100 + rank)
        )
        dist.barrier()
        started = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        elapsed = {"forward+backward": time.perf_counter() - started}
        for name, optimizer in optimizers.items():
            dist.barrier()
            started = time.perf_counter()
            optimizer.step()
            elapsed[name] = time.perf_counter() - started
        for opt in optimizers.values():
            if hasattr(opt, "zero_grad"):
                opt.zero_grad()
        if step >= warmup:
            for name, seconds in elapsed.items():
                times[name].append(seconds)
    gathered: list[Any] = [None] * ranks
    dist.all_gather_object(gathered, (times, {name: _state_bytes(o) for name, o in optimizers.items()}))
    if rank == 0:
        out.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def run(ranks: int, warmup: int, steps: int) -> list[Any]:
    schedule = plan(ranks)
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(target=_rank, args=(r, ranks, init, schedule, warmup, steps, queue)) for r in range(ranks)
        ]
        for process in processes:
            process.start()
        result = queue.get(timeout=1800)
        for process in processes:
            process.join()
    return result


def table(gathered: list[Any], ranks: int, groups: int) -> str:
    """The markdown table: medians of the slowest rank, ratios to canzona, state per rank."""
    names = list(gathered[0][0])
    slowest = {
        name: [max(rank[0][name][i] for rank in gathered) for i in range(len(gathered[0][0][name]))] for name in names
    }
    medians = {name: statistics.median(values) for name, values in slowest.items()}
    state = {name: max(rank[1].get(name, 0) for rank in gathered) for name in names if name != "forward+backward"}
    lines = [
        f"{ranks} CPU ranks (gloo, one thread each), FSDP2 over all of them, transformers Qwen3 "
        f"{CONFIG['num_hidden_layers']} layers x hidden {CONFIG['hidden_size']} (F {CONFIG['intermediate_size']}, "
        f"vocab {CONFIG['vocab_size']}), Muon, {groups} micro-groups; medians over {len(slowest['canzona'])} steps "
        "of the slowest rank's step()",
        "",
        "| optimizer | step ms | step / canzona | optimizer state MiB/rank |",
        "|---|---|---|---|",
    ]
    for name in ("canzona", "redundant", "adamw"):
        lines.append(
            f"| {name} | {medians[name] * 1e3:.1f} | {medians[name] / medians['canzona']:.2f}x | "
            f"{state[name] / 2**20:.2f} |"
        )
    lines.append(f"| (forward+backward) | {medians['forward+backward'] * 1e3:.1f} | - | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 warm-up and 4 timed steps (default 2 and 8)")
    args = parser.parse_args(argv)
    steps = 4 if args.quick else 8
    schedule = plan(args.ranks)
    print(table(run(args.ranks, 2, steps), args.ranks, len(schedule.tp.ranks[0].groups)))


if __name__ == "__main__":
    sys.exit(main())
