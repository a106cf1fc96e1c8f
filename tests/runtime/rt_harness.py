"""Multi-process test harness: run a function on N gloo ranks (fork start) and collect every rank's
result or error; make small schedules with the planner."""

from __future__ import annotations

import dataclasses
import io
import multiprocessing
import os
import queue as queue_module
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from canzona.runtime import CollectiveError
from canzona.runtime import make_groups as runtime_make_groups
from canzona.schedules.format import Schedule

DATA = Path(__file__).parent / "data"
GROUP_TIMEOUT = timedelta(seconds=30)


# Groups whose collectives wait longer than any test's bound on a refusal: a rank that waited
# for a collective timeout instead of refusing at once would take at least this long.
LONG_TIMEOUT = timedelta(seconds=120)
REFUSAL_S = 60.0  # only a rank that waited for LONG_TIMEOUT (or a hang) reaches it, on any machine


def make_groups(dp: int, tp: int, timeout: timedelta = GROUP_TIMEOUT) -> tuple[dist.ProcessGroup, ...]:
    """This rank's DP and TP groups (global rank = dp_rank · tp + tp_rank), with the tests'
    timeout so a broken collective fails instead of hanging."""
    return runtime_make_groups(dp, tp, timeout)


def optimizer_groups(schedule: Schedule) -> dict[str, Any]:
    """The process-group keywords of an optimizer for `schedule` (dp_group, tp_group and, under
    expert parallelism, expert_dp_group), with the tests' timeout."""
    req = schedule.request
    if req.ep == 1:
        dp_group, tp_group = runtime_make_groups(req.dp, req.tp, GROUP_TIMEOUT)
        return {"dp_group": dp_group, "tp_group": tp_group}
    dp_group, tp_group, expert_group = runtime_make_groups(req.dp, req.tp, GROUP_TIMEOUT, ep=req.ep)
    return {"dp_group": dp_group, "tp_group": tp_group, "expert_dp_group": expert_group}


def labelled(label: str) -> Callable[[str], str]:
    """An `assert_close` `msg` that puts `label` before torch's own message (the label is made
    when the call is, so a loop's later values never leak into it)."""
    return lambda message: f"{label}: {message}"


def _to_bytes(value: Any) -> bytes:
    """Results travel as torch.save bytes: torch's queue pickling would share tensors through
    file descriptors that die with the (immediately exiting) worker."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(fn: Callable[..., Any], rank: int, world: int, init_file: str, results: Any, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=GROUP_TIMEOUT
        )
        outcome: tuple[str, Any] = ("ok", _to_bytes(fn(rank, world, *args)))
    except BaseException as error:
        outcome = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    results.put((rank, *outcome))
    results.close()
    results.join_thread()
    # Skip destroy_process_group: a rank that failed early must not wait for the others.
    os._exit(0)


def run_ranks_raw(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 90.0) -> dict[int, tuple[str, Any]]:
    """Run `fn(rank, world, *args)` on `world` forked gloo ranks; {rank: (status, payload)},
    status "ok", "error", "died" (exited without a result) or "timeout"."""
    context = mp.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(target=_worker, args=(fn, r, world, init_file, results, args)) for r in range(world)
        ]
        for process in processes:
            process.start()
        outcomes: dict[int, tuple[str, Any]] = {}
        exited: dict[int, int | None] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcomes) < world and time.monotonic() < deadline:
                try:
                    rank, status, payload = results.get(timeout=min(0.5, max(0.1, deadline - time.monotonic())))
                except queue_module.Empty:
                    # A rank that died without reporting (e.g. killed on purpose) never will.
                    if all(not processes[r].is_alive() for r in range(world) if r not in outcomes):
                        deadline = min(deadline, time.monotonic() + 1.0)  # drain what is still in the pipe
                    continue
                outcomes[rank] = (status, _from_bytes(payload) if status == "ok" else payload)
            exited = {r: p.exitcode for r, p in enumerate(processes) if not p.is_alive()}
        finally:
            for process in processes:
                process.join(timeout=5)
                if process.is_alive():
                    process.kill()
                    process.join()
    for rank in range(world):
        if exited.get(rank, 0) != 0:
            outcomes.setdefault(rank, ("died", f"rank {rank} exited with code {exited[rank]} without a result"))
        outcomes.setdefault(rank, ("timeout", f"rank {rank} gave no result within {timeout:.0f} s"))
    return outcomes


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 90.0) -> list[Any]:
    """Like `run_ranks_raw`, but fail the test with every failing rank's message."""
    outcomes = run_ranks_raw(fn, world, *args, timeout=timeout)
    failures = [
        f"--- rank {rank} ({status}) ---\n{payload}"
        for rank, (status, payload) in sorted(outcomes.items())
        if status != "ok"
    ]
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return [outcomes[rank][1] for rank in range(world)]


def _cli_child(args: list[str], results: Any) -> None:
    from canzona.cli.main import main

    results.put(main(args))


def canzona_in_child(args: list[str]) -> None:
    """`canzona ARGS` in a forked child (a factory that opens a fake process group must not
    leave it in the test process); fails the test unless it exits 0."""
    context = mp.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_cli_child, args=(args, results))
    child.start()
    try:
        code = results.get(timeout=120)
    except queue_module.Empty:
        child.kill()
        pytest.fail(f"canzona {' '.join(args)} did not finish")
    child.join(timeout=30)
    assert code == 0, f"canzona {' '.join(args)} exited {code}"


def make_schedule(
    model: str | Path,
    tp: int,
    dp: int,
    *,
    optimizer: str = "muon",
    alpha: float = 1.0,
    bucket_size: int = 4000,
    group_bytes: int = 4096,
    dtype: str = "fp32",
    split_fc1: bool = False,
    ep: int = 1,
    coop: str = "auto",
    order: str = "registration",
    tp_update: str = "auto",
    **settings: Any,
) -> Schedule:
    """A planner-made schedule for `model` (a file), with small buckets and micro-groups,
    its parameters' dtype set to `dtype` (`ep`: expert parallelism; `coop`: cooperative
    hosting, `force` to team every eligible matrix; `order`: a bucket's parameter order,
    registration or free; `tp_update`: replicated for every TP rank to update every matrix)."""
    from canzona.planner.compile import compile_schedule
    from canzona.planner.partition.costs import OptimizerConfig
    from canzona.planner.plan import PlanRequest, make_plan
    from canzona.planner.sources.load import load_model
    from canzona.planner.spec import ModelOptions

    options = ModelOptions(split_fc1=split_fc1)
    spec = load_model(str(model), tp, options)
    spec = dataclasses.replace(spec, params=tuple(dataclasses.replace(p, dtype=dtype) for p in spec.params))
    request = PlanRequest(
        model=str(model),
        tp=tp,
        dp=dp,
        optimizer=OptimizerConfig(optimizer, **settings),
        alpha=alpha,
        bucket_size=bucket_size,
        options=options,
        group_bytes=group_bytes,
        ep=ep,
        coop=coop,
        order=order,
        tp_update=tp_update,
    )
    return compile_schedule(make_plan(spec, request))


def timed_collective_failure(optimizer: Any) -> dict[str, Any]:
    """Step once: the CollectiveError it raises (None: none) and how long the step took; after
    one, the next step must refuse at once (the groups cannot be trusted)."""
    started = time.monotonic()
    try:
        optimizer.step()
    except CollectiveError as error:
        elapsed = time.monotonic() - started
        with pytest.raises(CollectiveError, match="an earlier collective failed"):
            optimizer.step()
        return {"error": str(error), "elapsed": elapsed}
    return {"error": None, "elapsed": time.monotonic() - started}


def reload_and_step(
    optimizer: Any, state: dict[str, Any], params: list[tuple[str, torch.Tensor]], values: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """After a failed step: load the optimizer `state` and the parameters' `values` saved
    before it (a checkpoint), step again (the groups are still usable) and return the values."""
    optimizer.load_state_dict(state)
    with torch.no_grad():
        for (_, param), value in zip(params, values):
            param.copy_(value)
    optimizer.step()
    return {name: p.detach().clone() for name, p in params}


def _child(fn: Callable[[], Any], results: Any) -> None:
    try:
        results.put(("ok", fn()))
    except BaseException as error:
        results.put(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def in_child(fn: Callable[[], Any], timeout: float = 120.0) -> Any:
    """Run `fn` in a forked process (its process group dies with it); its result or error."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    process = context.Process(target=_child, args=(fn, results))
    process.start()
    try:
        status, payload = results.get(timeout=timeout)
    except queue_module.Empty:
        process.kill()
        pytest.fail("the child process did not report in time")
    process.join(timeout=30)
    if status == "error":
        pytest.fail(payload)
    return payload


def fake_world(world: int, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A DeviceMesh over a fake (communication-free) process group of `world` ranks."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)


def torchrun(driver: Path, ranks: int, args: Sequence[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc-per-node RANKS DRIVER ARGS...` in a subprocess (one thread
    per rank, warnings off); its completed process, whatever its exit code."""
    launcher = Path(sys.executable).with_name("torchrun")
    command = [str(launcher), "--standalone", "--nproc-per-node", str(ranks), str(driver), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
