"""The CLI for the models people have: `plan --names`, `--sequence-parallel`, live models
(`plan --model py:MODULE:FACTORY`, `describe`), `check` of such schedules, and their errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from canzona.cli.main import main
from canzona.schedules.format import read_schedule

ROOT = Path(__file__).resolve().parents[2]
TINY_MOE = ROOT / "tests" / "runtime" / "data" / "tiny_moe.json"
FACTORIES = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.embed = nn.Embedding(64, width)
        self.proj = nn.Linear(width, width, bias=False)
        self.experts = nn.Parameter(torch.empty(4, 2 * width, width))
        self.norm = nn.RMSNorm(width)
        self.lm_head = nn.Linear(width, 64, bias=False)


def small():
    return Block(WIDTH).to(torch.bfloat16)


def fails():
    raise ValueError("cannot build this here")


def not_a_model():
    return 42
"""


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES.replace("WIDTH", "16"))
    return path


def test_config_plans_with_transformers_names_unless_told(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf, megatron = tmp_path / "hf.yaml", tmp_path / "megatron.yaml"
    assert run_cli(["plan", "--model", str(TINY_MOE), "--tp", "2", "--dp", "2", "-o", str(hf)], capsys)[0] == 0
    schedule = read_schedule(hf)
    assert schedule.request.names == "hf"
    assert {e.param for e in schedule.params if e.param} == {
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
    }
    args = ["plan", "--model", str(TINY_MOE), "--tp", "2", "--dp", "2", "--names", "megatron", "-o", str(megatron)]
    assert run_cli(args, capsys)[0] == 0
    assert read_schedule(megatron).request.names == "megatron"
    assert "names:" not in megatron.read_text()  # the default is not written
    code, out, _ = run_cli(["check", str(hf), str(megatron)], capsys)
    assert code == 0 and out.count("fresh") == 2


def test_presets_take_every_convention(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for names, first in (
        ("megatron", "embedding.word_embeddings.weight"),
        ("hf", "model.embed_tokens.weight"),
        ("torchtitan", "tok_embeddings.weight"),
    ):
        target = tmp_path / f"{names}.yaml"
        args = ["plan", "--model", "qwen3-0.6b", "--tp", "2", "--dp", "2", "--names", names, "-o", str(target)]
        assert run_cli(args, capsys)[0] == 0
        schedule = read_schedule(target)
        assert min(schedule.params, key=lambda e: e.index).name == first
        assert not any(e.grad_reduce for e in schedule.params)  # no stack needs it by default


def test_sequence_parallel_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "sp.yaml"
    args = ["plan", "--model", "qwen3-0.6b", "--tp", "2", "--dp", "2", "--sequence-parallel", "-o", str(target)]
    assert run_cli(args, capsys)[0] == 0
    schedule = read_schedule(target)
    assert schedule.request.sequence_parallel
    assert {e.name for e in schedule.params if e.grad_reduce} == {e.name for e in schedule.params if "norm" in e.name}
    assert run_cli(["check", str(target)], capsys)[0] == 0


def test_live_model_plans_describes_and_checks(
    factories: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = f"py:{factories}:small"
    planned, described = tmp_path / "live.yaml", tmp_path / "params.yaml"
    code, _, err = run_cli(["plan", "--model", source, "--dp", "2", "-o", str(planned)], capsys)
    assert code == 0, err
    schedule = read_schedule(planned)
    assert schedule.request.model.source == source and schedule.request.model.name == "small"
    # named_parameters() order: a module's own parameters before its children's.
    assert [e.name for e in sorted(schedule.params, key=lambda e: e.index)] == [
        "experts[0]",
        "experts[1]",
        "experts[2]",
        "experts[3]",
        "embed.weight",
        "proj.weight",
        "norm.weight",
        "lm_head.weight",
    ]
    assert {e.dtype for e in schedule.params} == {"bf16"}
    code, out, _ = run_cli(["describe", "--model", source], capsys)
    assert code == 0
    listing = yaml.safe_load(out)
    assert listing["name"] == "small" and listing["params"][0] == {
        "name": "experts",
        "shape": [4, 32, 16],
        "tp_dim": None,
        "dtype": "bf16",
        "optimizer": "matrix",
        "grouped_experts": True,
    }
    code, out, _ = run_cli(["describe", "--model", source, "-o", str(described)], capsys)
    assert code == 0 and "5 parameters of small (2 matrices, 1 grouped expert tensors)" in out
    assert described.read_text() == run_cli(["describe", "--model", source], capsys)[1]
    from_file = tmp_path / "from-file.yaml"
    assert run_cli(["plan", "--model", str(described), "--dp", "2", "-o", str(from_file)], capsys)[0] == 0
    assert read_schedule(from_file).params == schedule.params
    code, out, err = run_cli(["check", str(planned)], capsys)  # runs no code unless told to
    assert code == 2 and out == "" and "cannot be regenerated without running code" in err
    code, out, _ = run_cli(["check", "--allow-code", str(planned)], capsys)
    assert code == 0 and out.startswith("fresh")
    factories.write_text(FACTORIES.replace("WIDTH", "32"))  # the model changed
    code, out, _ = run_cli(["check", "--allow-code", str(planned)], capsys)
    assert code == 1 and "STALE" in out and "stale fingerprint" in out


@pytest.mark.parametrize(
    "args, needles",
    [
        (["plan", "--model", "py:FACTORIES:fails"], ["model factory py:", "raised ValueError: cannot build this here"]),
        (["plan", "--model", "py:FACTORIES:absent"], ["has no 'absent'"]),
        (["plan", "--model", "py:FACTORIES:not_a_model"], ["returned a value of type int, not a torch.nn.Module"]),
        (["plan", "--model", "py:no_such_package.models:make"], ["cannot import 'no_such_package.models'"]),
        (["plan", "--model", "py:FACTORIES:small", "--names", "hf"], ["--names hf applies to presets", "live model"]),
        (
            ["plan", "--model", str(ROOT / "examples" / "tiny_qwen3.yaml"), "--names", "torchtitan"],
            ["--names torchtitan applies"],
        ),
        (
            ["plan", "--model", str(ROOT / "examples" / "tiny_qwen3.yaml"), "--names", "megatron"],
            ["--names megatron applies to presets", "a parameter list names its parameters itself"],
        ),
        (
            ["plan", "--model", "py:FACTORIES:small", "--names", "megatron"],
            ["--names megatron applies", "a live model"],
        ),
        (["plan", "--model", "py:FACTORIES:small", "--split-qkv", "head"], ["split_qkv head has no effect on small"]),
        (["plan", "--model", "py:FACTORIES:small", "--split-fc1"], ["split_fc1 true has no effect on small"]),
        (
            ["plan", "--model", "py:FACTORIES:small", "--tp", "2"],
            ["shows no TP layout", "at --tp 2 its parameters would be planned as whole matrices", "parallelize_module"],
        ),
        (
            ["plan", "--model", "qwen3-0.6b", "--names", "hf", "--split-qkv", "none"],
            ["split_qkv none", "separate parameters"],
        ),
        (["describe", "--model", "qwen3-8b"], ["describe reads a live model", "py:MODULE:FACTORY"]),
        (["describe", "--model", "py:FACTORIES:small", "-o", "FACTORIES"], ["is also an input"]),
        (["plan", "--model", "py:FACTORIES:small", "-o", "FACTORIES"], ["is also an input"]),
    ],
)
def test_bad_live_models_and_names(
    args: list[str], needles: list[str], factories: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = factories.read_text()
    code, out, err = run_cli([a.replace("FACTORIES", str(factories)) for a in args], capsys)
    assert code == 2 and err.startswith("canzona: error: ") and err.count("\n") == 1, err
    assert all(needle in err for needle in needles), err
    assert factories.read_text() == before


def test_described_tp_size_must_match(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    listing = tmp_path / "params.yaml"
    listing.write_text('name: m\ntp: 2\nparams:\n- {"name": "w", "shape": [8, 8], "tp_dim": 0, "dtype": "fp32"}\n')
    code, _, err = run_cli(["plan", "--model", str(listing), "--tp", "4", "-o", str(tmp_path / "x.yaml")], capsys)
    assert code == 2 and "read from a model at TP 2 (its 'tp' key); plan it with --tp 2, not 4" in err


@pytest.mark.parametrize(
    "model, message",
    [
        ("py:missing.py:make", "no such model file 'missing.py'"),
        (
            "py:no_such_package_zz.models:make",
            "cannot import 'no_such_package_zz.models': No module named 'no_such_package_zz'",
        ),
        ("py:models.py", "a live model is py:MODULE:FACTORY"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "describe"])
def test_a_live_model_that_cannot_load_is_refused_before_torch(
    model: str, message: str, command: str, tmp_path: Path
) -> None:
    probe = (
        "import sys; from canzona.cli.main import main; "
        f"code = main([{command!r}, '--model', {model!r}]); "
        "print(code, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path)
    code, torch_loaded = done.stdout.split()
    assert (code, torch_loaded) == ("2", "False")  # refused before the heavy import, whatever the machine's speed
    assert done.stderr.startswith(f"canzona: error: {message}") and done.stderr.count("\n") == 1, done.stderr


def test_planning_without_a_live_model_imports_no_torch(tmp_path: Path) -> None:
    probe = (
        "import sys; from canzona.cli.main import main; "
        f"code = main(['plan', '--model', {str(TINY_MOE)!r}, '--tp', '2', '--dp', '2', '--names', 'torchtitan', "
        f"'--sequence-parallel', '-o', {str(tmp_path / 'x.yaml')!r}]); "
        "assert code == 0; assert 'torch' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True)


TP_FACTORY = """
import sys
import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, RUNTIME_TESTS)
from titan_model import TitanModel, parallelize_titan


def titan():
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_titan(TitanModel(), mesh["tp"])
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])
"""


@pytest.mark.slow
def test_plan_a_dtensor_model_from_its_factory(tmp_path: Path) -> None:
    """A torchtitan-style model under TP 2 x FSDP2 (fake process group), planned in one command."""
    factory = tmp_path / "titan_factory.py"
    factory.write_text(TP_FACTORY.replace("RUNTIME_TESTS", repr(str(ROOT / "tests" / "runtime"))))
    target = tmp_path / "titan.yaml"
    command = [
        sys.executable,
        "-m",
        "canzona.cli",
        "plan",
        "--model",
        f"py:{factory}:titan",
        "--tp",
        "2",
        "--dp",
        "2",
        "--sequence-parallel",
        "--json",
        "-o",
        str(target),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tp"] == 2
    schedule = read_schedule(target)
    tp_dims = {e.name: e.tp_dim for e in schedule.params}
    assert tp_dims["layers.0.attention.qkv_linear.wqkv.weight"] == 0
    assert tp_dims["layers.1.moe.routed_experts.inner_experts.w2_EDF[3]"] == 1
    assert {e.name for e in schedule.params if e.grad_reduce} == {e.name for e in schedule.params if "norm" in e.name}
    wrong = subprocess.run(
        command[:8] + ["--tp", "4", "--dp", "1", "-o", str(tmp_path / "y.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert wrong.returncode == 2 and "read from a model at TP 2" in wrong.stderr and wrong.stderr.count("\n") == 1


def test_simulate_a_live_moe_schedule_needs_the_routed_fraction(
    factories: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A live model has no config to read top_k / num_experts from; its expert slices say which
    parameters are experts."""
    target = tmp_path / "live.yaml"
    assert run_cli(["plan", "--model", f"py:{factories}:small", "--dp", "2", "-o", str(target)], capsys)[0] == 0
    code, _, err = run_cli(["simulate", str(target)], capsys)
    assert code == 2 and "give --routed-fraction" in err
    code, out, err = run_cli(["simulate", str(target), "--routed-fraction", "0.5", "--json"], capsys)
    assert code == 0, err
