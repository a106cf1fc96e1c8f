"""A tiny Qwen3-style decoder with Megatron-core parameter names and tensor-parallel linears
written on plain torch.distributed (column/row parallel, vocab-parallel embedding and output).

Parameters are registered in the order canzona's catalog expands a Qwen3 config, so a
schedule planned from `tiny_qwen3.json` (or the parameter list `tiny_qwen3.yaml`) matches
`named_parameters()`. With `tp_group=None` the same class is the unsharded single-process twin.

TP layouts (Megatron): `linear_qkv` rows are grouped per KV group as [q heads, k, v] and split
by groups; each `linear_fc1` shard holds [gate shard; up shard]; `linear_proj` and
`linear_fc2` are split along their input dim; embedding and output layer along the vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class TinyConfig:
    """Shapes of the tiny model (a Qwen3 config.json with these values plans the same)."""

    hidden: int = 64
    ffn: int = 128
    layers: int = 2
    heads: int = 4
    kv_groups: int = 2
    head_dim: int = 16
    vocab: int = 256
    eps: float = 1e-6

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> TinyConfig:
        """Read the keys of a Hugging Face Qwen3 config."""
        return cls(
            config["hidden_size"],
            config["intermediate_size"],
            config["num_hidden_layers"],
            config["num_attention_heads"],
            config["num_key_value_heads"],
            config["head_dim"],
            config["vocab_size"],
        )


class _CopyToTp(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient over TP backward (Megatron's f)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTp(torch.autograd.Function):
    """All-reduce over TP forward; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromTp(torch.autograd.Function):
    """All-gather along the last dim forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.rank, ctx.width = rank, x.size(-1)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(), None


class Tp:
    """The TP group this model is sharded over (None: unsharded, size 1)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def copy(self, x: Tensor) -> Tensor:
        return x if self.size == 1 else _CopyToTp.apply(x, self.group)

    def reduce(self, x: Tensor) -> Tensor:
        return x if self.size == 1 else _ReduceFromTp.apply(x, self.group)

    def gather(self, x: Tensor) -> Tensor:
        return x if self.size == 1 else _GatherFromTp.apply(x, self.group)


def _weight(rows: int, cols: int, tp_dim: int | None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(rows, cols))
    if tp_dim is not None:  # Megatron's markers; canzona checks them against the schedule
        param.tensor_model_parallel = True  # type: ignore[attr-defined]
        param.partition_dim = tp_dim  # type: ignore[attr-defined]
    return param


def _norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class _Linear(nn.Module):
    """A weight, optionally with a fused input RMSNorm (`layer_norm_weight`, as in TE)."""

    def __init__(self, rows: int, cols: int, tp_dim: int | None, norm: int = 0) -> None:
        super().__init__()
        if norm:
            self.layer_norm_weight = nn.Parameter(torch.ones(norm))
        self.weight = _weight(rows, cols, tp_dim)


class _Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class Attention(nn.Module):
    """GQA self-attention with qk-norm and RoPE; QKV column-parallel, proj row-parallel."""

    def __init__(self, cfg: TinyConfig, tp: Tp) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.groups = cfg.kv_groups // tp.size
        per_group = cfg.heads // cfg.kv_groups
        self.linear_proj = _Linear(cfg.hidden, cfg.heads * cfg.head_dim // tp.size, 1)
        self.linear_qkv = _Linear(self.groups * (per_group + 2) * cfg.head_dim, cfg.hidden, 0, norm=cfg.hidden)
        self.q_layernorm = _Norm(cfg.head_dim)
        self.k_layernorm = _Norm(cfg.head_dim)

    def forward(self, x: Tensor) -> Tensor:
        cfg, (batch, length, _) = self.cfg, x.shape
        per_group = cfg.heads // cfg.kv_groups
        h = self.tp.copy(_norm(x, self.linear_qkv.layer_norm_weight, cfg.eps))
        qkv = (h @ self.linear_qkv.weight.T).view(batch, length, self.groups, per_group + 2, cfg.head_dim)
        # Each TP rank normalises only its heads: copy() sums the qk-norm weight gradients over
        # TP (Megatron all-reduces them in finalize_model_grads) so every rank holds the full one.
        q = _norm(qkv[:, :, :, :per_group], self.tp.copy(self.q_layernorm.weight), cfg.eps).flatten(2, 3)
        k = _norm(qkv[:, :, :, per_group], self.tp.copy(self.k_layernorm.weight), cfg.eps)
        v = qkv[:, :, :, per_group + 1]
        q, k = _rope(q), _rope(k)
        k, v = (t.repeat_interleave(per_group, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        out = out.transpose(1, 2).reshape(batch, length, -1)
        return self.tp.reduce(out @ self.linear_proj.weight.T)


def _rope(x: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary embedding over the last dim of [batch, length, heads, dim]."""
    length, dim = x.size(1), x.size(-1)
    freqs = base ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim)
    angles = torch.arange(length, dtype=torch.float32, device=x.device)[:, None] * freqs[None]
    cos, sin = angles.cos()[None, :, None].to(x.dtype), angles.sin()[None, :, None].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Mlp(nn.Module):
    """SwiGLU: fc1 column-parallel (local rows [gate shard; up shard]), fc2 row-parallel."""

    def __init__(self, cfg: TinyConfig, tp: Tp) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.linear_fc1 = _Linear(2 * cfg.ffn // tp.size, cfg.hidden, 0, norm=cfg.hidden)
        self.linear_fc2 = _Linear(cfg.hidden, cfg.ffn // tp.size, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.tp.copy(_norm(x, self.linear_fc1.layer_norm_weight, self.cfg.eps))
        gate, up = (h @ self.linear_fc1.weight.T).chunk(2, dim=-1)
        return self.tp.reduce((F.silu(gate) * up) @ self.linear_fc2.weight.T)


class Layer(nn.Module):
    def __init__(self, cfg: TinyConfig, tp: Tp) -> None:
        super().__init__()
        self.self_attention = Attention(cfg, tp)
        self.mlp = Mlp(cfg, tp)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attention(x)
        return x + self.mlp(x)


class FinalNorm(_Norm):
    """The last RMSNorm, called as a module (so hooks on it see its weight)."""

    def __init__(self, cfg: TinyConfig, tp: Tp) -> None:
        super().__init__(cfg.hidden)
        self.eps, self.tp = cfg.eps, tp

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.copy(_norm(x, self.weight, self.eps))


class Decoder(nn.Module):
    def __init__(self, cfg: TinyConfig, tp: Tp) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(cfg, tp) for _ in range(cfg.layers))
        self.final_layernorm = FinalNorm(cfg, tp)


class Embedding(nn.Module):
    """Vocab-parallel embedding: each TP rank looks up its rows, the sum over TP completes it."""

    def __init__(self, cfg: TinyConfig, tp: Tp) -> None:
        super().__init__()
        self.tp = tp
        self.word_embeddings = _Linear(cfg.vocab // tp.size, cfg.hidden, 0)

    def forward(self, tokens: Tensor) -> Tensor:
        weight = self.word_embeddings.weight
        local = tokens - self.tp.rank * weight.size(0)
        inside = (local >= 0) & (local < weight.size(0))
        return self.tp.reduce(F.embedding(local.clamp(0, weight.size(0) - 1), weight) * inside[..., None])


class OutputLayer(_Linear):
    """Vocab-parallel output projection, gathered over TP."""

    def __init__(self, cfg: TinyConfig, tp: Tp) -> None:
        super().__init__(cfg.vocab // tp.size, cfg.hidden, 0)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.gather(x @ self.weight.T)


class TinyQwen3(nn.Module):
    """The model; `forward(tokens)` returns the mean next-token cross-entropy. Every parameter
    is used inside the forward of the module holding it (or of its nearest ancestor with a
    forward, for weight holders), as forward pre-hooks such as canzona's gather overlap need."""

    def __init__(self, cfg: TinyConfig, tp_group: Any = None) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, Tp(tp_group)
        self.embedding = Embedding(cfg, self.tp)
        self.decoder = Decoder(cfg, self.tp)
        self.output_layer = OutputLayer(cfg, self.tp)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens[:, :-1])
        for layer in self.decoder.layers:
            x = layer(x)
        logits = self.output_layer(self.decoder.final_layernorm(x))
        return F.cross_entropy(logits.reshape(-1, self.cfg.vocab).float(), tokens[:, 1:].reshape(-1))


def _is_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


def init_full_state(cfg: TinyConfig, seed: int = 0) -> dict[str, Tensor]:
    """Deterministic full (unsharded, canonical) weights: fc1 rows are [gate; up]."""
    generator = torch.Generator().manual_seed(seed)
    twin = TinyQwen3(cfg)
    state = {}
    for name, param in twin.named_parameters():
        if param.dim() == 1:
            state[name] = torch.ones_like(param)
        else:
            state[name] = torch.randn(param.shape, generator=generator) / math.sqrt(param.size(1))
    return state


def shard_state(full: dict[str, Tensor], tp: int, rank: int) -> dict[str, Tensor]:
    """TP rank `rank`'s shard of canonical full weights (fc1 shard = [gate shard; up shard])."""
    out = {}
    for name, tensor in full.items():
        dim = _split_dim(name)
        if dim is None:
            out[name] = tensor.clone()
        elif _is_fc1(name):
            gate, up = tensor.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]).clone()
        else:
            out[name] = tensor.chunk(tp, dim=dim)[rank].clone()
    return out


def gather_state(shards: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Canonical full weights from every TP rank's shard (the inverse of `shard_state`)."""
    out = {}
    for name in shards[0]:
        dim, parts = _split_dim(name), [s[name] for s in shards]
        if dim is None:
            out[name] = parts[0].clone()
        elif _is_fc1(name):
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            out[name] = torch.cat(parts, dim=dim)
    return out


def _split_dim(name: str) -> int | None:
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if (
        name.endswith(("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight"))
        or name == "output_layer.weight"
    ):
        return 0
    return None


def synthetic_batch(cfg: TinyConfig, batch: int, length: int, seed: int) -> Tensor:
    """Token sequences following a fixed random successor map (learnable: the loss falls)."""
    successor = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(1234))
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(batch, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab, (batch,), generator=generator)
    for position in range(1, length):
        tokens[:, position] = successor[tokens[:, position - 1]]
    return tokens
