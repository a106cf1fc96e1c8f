"""torchtitan 0.3.0's own Qwen3 model, tiny (the sizes of tests/runtime/titan_model.py), dense or
with MoE layers, for the tests against the real package; and the Hugging Face config.json of the
same architecture, which `canzona plan --names torchtitan` expands to torchtitan's names.

torchtitan picks its device type at import (CUDA where it can); `use_cpu()` points it at the
CPU before its distributed code is imported, as the CPU tests need."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SIZES = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256)
HIDDEN, MOE_HIDDEN, EXPERTS, TOP_K, LAYERS = 128, 32, 4, 2, 2


def use_cpu() -> None:
    """Make torchtitan place meshes and tensors on the CPU (it chose CUDA at import otherwise)."""
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type, titan_utils.device_module = "cpu", torch.cpu


def config(moe: bool = False) -> Any:
    """The tiny Qwen3Model.Config: 2 layers, the second MoE when `moe`; attention by CPU SDPA."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    dim, vocab = SIZES["dim"], SIZES["vocab_size"]
    attention = dict(
        dim=dim,
        n_heads=SIZES["n_heads"],
        n_kv_heads=SIZES["n_kv_heads"],
        head_dim=SIZES["head_dim"],
        attn_backend="flex",
        rope=CosSinRoPE.Config(dim=SIZES["head_dim"], max_seq_len=64, theta=1e6),
    )
    layers = _build_qwen3_layers(n_layers=1 if moe else LAYERS, hidden_dim=HIDDEN, **attention)
    if moe:
        layers += _build_qwen3_moe_layers(
            n_layers=1,
            moe_hidden_dim=MOE_HIDDEN,
            num_experts=EXPERTS,
            top_k=TOP_K,
            moe_comm_backend="standard",
            **attention,
        )
    for layer in layers:  # flex attention needs a compiler; SDPA computes the same attention on the CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=False,
        layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
    )


def build(moe: bool = False, seed: int = 0) -> torch.nn.Module:
    """The model, initialized from `seed` (the same weights in every process)."""
    torch.manual_seed(seed)
    return config(moe).build()


def hf_config(path: Path, moe: bool = False) -> Path:
    """The same architecture as a transformers config.json (fp32), written to `path`."""
    data: dict[str, Any] = {
        "model_type": "qwen3_moe" if moe else "qwen3",
        "hidden_size": SIZES["dim"],
        "num_attention_heads": SIZES["n_heads"],
        "num_key_value_heads": SIZES["n_kv_heads"],
        "head_dim": SIZES["head_dim"],
        "vocab_size": SIZES["vocab_size"],
        "intermediate_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    if moe:
        data.update(
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=MOE_HIDDEN,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
        )
    path.write_text(json.dumps(data))
    return path
