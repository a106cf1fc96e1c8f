"""`--dtype` and a config.json's own dtype; TP sizes that shard a dim unevenly (torch.chunk)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from canzona.schedules.format import read_schedule

from cli_run import refused, run

# A Qwen3 config whose heads (24), KV heads (6) and FFN (9216) divide by 3 and whose
# vocabulary (151936 = 3 x 50645 + 1) does not.
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 128,
    "hidden_size": 3072,
    "intermediate_size": 9216,
    "num_attention_heads": 24,
    "num_key_value_heads": 6,
    "num_hidden_layers": 4,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}


def config(tmp_path: Path, **changes: Any) -> str:
    path = tmp_path / "qwen3-config" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(QWEN3 | changes))
    return str(path)


def test_tp3_dp5_plans_qwen3s_vocabulary_in_uneven_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.yaml"
    code, _, err = run(["plan", "--model", config(tmp_path), "--tp", "3", "--dp", "5", "-o", str(out)], capsys)
    assert code == 0, err
    schedule = read_schedule(out)  # validated
    head = next(e for e in schedule.params if e.name == "lm_head.weight")
    assert head.shape == [151936, 3072] and head.tp_dim == 0 and head.numel == 50646 * 3072  # the largest chunk
    code, out_text, _ = run(["check", str(out)], capsys)
    assert code == 0 and "fresh" in out_text


def test_a_config_plans_in_its_dtype_and_dtype_overrides_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = config(tmp_path, torch_dtype="float32")
    own, forced = tmp_path / "own.yaml", tmp_path / "forced.yaml"
    assert run(["plan", "--model", source, "--dp", "2", "-o", str(own)], capsys)[0] == 0
    assert run(["plan", "--model", source, "--dp", "2", "--dtype", "bf16", "-o", str(forced)], capsys)[0] == 0
    planned, overridden = read_schedule(own), read_schedule(forced)
    assert {e.dtype for e in planned.params} == {"fp32"} and planned.request.dtype is None
    assert {e.dtype for e in overridden.params} == {"bf16"} and overridden.request.dtype == "bf16"
    for path in (own, forced):  # the request regenerates the same file
        code, out_text, _ = run(["check", str(path)], capsys)
        assert code == 0 and "fresh" in out_text


def test_a_dtype_canzona_does_not_plan_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refused(
        ["plan", "--model", config(tmp_path, torch_dtype="float64"), "-o", str(tmp_path / "s.yaml")],
        capsys,
        "float64",
        "--dtype",
    )
    refused(["plan", "--model", "qwen3-0.6b", "--dtype", "fp8", "-o", str(tmp_path / "s.yaml")], capsys, "fp8")
    assert not (tmp_path / "s.yaml").exists()


def test_describe_dtype_sets_every_parameter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    factory = Path(__file__).resolve().parents[1] / "runtime" / "titan_model.py"
    out = tmp_path / "params.yaml"
    code, _, err = run(["describe", "--model", f"py:{factory}:TitanModel", "--dtype", "fp16", "-o", str(out)], capsys)
    assert code == 0, err
    assert "fp16" in out.read_text() and "fp32" not in out.read_text()


def test_a_config_without_a_dtype_says_which_it_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`config.save_pretrained()` writes no dtype; transformers builds such a model in fp32, the
    plan takes the default bf16 and says so on stderr (with the flag for fp32); with a dtype, or
    with --dtype, nothing is said."""
    source = config(tmp_path)
    code, _, err = run(["plan", "--model", source, "--dp", "2", "-o", str(tmp_path / "a.yaml")], capsys)
    assert code == 0 and "declares no dtype: planned in bf16" in err and "--dtype fp32" in err
    assert {e.dtype for e in read_schedule(tmp_path / "a.yaml").params} == {"bf16"}
    for extra in (["--dtype", "fp32"], []):
        source = config(tmp_path, torch_dtype="float32") if not extra else source
        code, _, err = run(
            ["plan", "--model", source, "--dp", "2", *extra, "-o", str(tmp_path / f"b{len(extra)}.yaml")], capsys
        )
        assert code == 0 and "declares no dtype" not in err
