"""A tiny Qwen3-MoE-style decoder with Megatron-core parameter names, tensor- and
expert-parallel, on plain torch.distributed: the MoE variant of `tiny_qwen3.py`.

Layer 0 has a dense SwiGLU MLP; every later layer routes each token to `top_k` of `experts`
SwiGLU experts (softmax router, top-k probabilities renormalised). Names and registration
order follow canzona's catalog of a Qwen3-MoE config with `--names megatron`
(`tiny_qwen3_moe.json`): `pre_mlp_layernorm.weight`, `mlp.router.weight` [experts, hidden],
then `mlp.experts.linear_fc1.weight<e>` for every expert, then every `linear_fc2.weight<e>`
(Megatron's TEGroupedMLP). Expert `e` is named by its global index on the EP rank holding it,
ep_rank = e // (experts / ep), as the planner places it.

Expert parallelism: the EP group is the `ep` DP ranks that share an expert-DP rank (DP rank =
expert_dp_rank · ep + ep_rank, same TP rank). Tokens travel with Megatron's all-gather
dispatcher: every EP rank gathers the group's tokens and routing weights, its experts process
the tokens routed to them, and a reduce-scatter (here an all-reduce and a slice: gloo has no
reduce-scatter) returns each rank the sum over experts for its own tokens. Backward through
it gives an expert the sum of the gradients of every EP-group rank's loss, which canzona then
sums over the expert-DP group and divides by the DP size. With `ep_group=None` and
`tp_group=None` the same class is the unsharded single-process twin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tiny_qwen3 import Attention, Embedding, FinalNorm, Mlp, OutputLayer, TinyConfig, Tp, _Linear, _norm, _weight
from tiny_qwen3 import gather_state as dense_gather_state
from tiny_qwen3 import shard_state as dense_shard_state


@dataclass(frozen=True)
class MoeConfig(TinyConfig):
    """The tiny model's shapes plus its experts (a Qwen3-MoE config with these values plans
    the same; layers listed in `dense_layers` keep a dense MLP)."""

    hidden: int = 32
    ffn: int = 64
    head_dim: int = 8
    vocab: int = 256
    experts: int = 4
    top_k: int = 2
    expert_ffn: int = 32
    dense_layers: tuple[int, ...] = (0,)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> MoeConfig:
        """Read the keys of a Hugging Face Qwen3-MoE config."""
        return cls(
            config["hidden_size"],
            config["intermediate_size"],
            config["num_hidden_layers"],
            config["num_attention_heads"],
            config["num_key_value_heads"],
            config["head_dim"],
            config["vocab_size"],
            experts=config["num_experts"],
            top_k=config["num_experts_per_tok"],
            expert_ffn=config["moe_intermediate_size"],
            dense_layers=tuple(config.get("mlp_only_layers", ())),
        )


class _GatherFromEp(torch.autograd.Function):
    """All-gather along dim 0 over the EP group forward; backward, the sum over the group of
    the gradient of this rank's part (every rank's experts used its tokens)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group, ctx.rank, ctx.rows = group, dist.get_rank(group), x.size(0)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None


class _ReduceScatterToEp(torch.autograd.Function):
    """Sum over the EP group, keeping this rank's rows (dim 0) forward; all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        rows = x.size(0) // size
        return total[rank * rows : (rank + 1) * rows]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class Ep:
    """The EP group the experts are spread over (None: every expert here)."""

    def __init__(self, group: Any, experts: int) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.local = range(self.rank * experts // self.size, (self.rank + 1) * experts // self.size)

    def dispatch(self, x: Tensor) -> Tensor:
        return x if self.size == 1 else _GatherFromEp.apply(x, self.group)

    def combine(self, x: Tensor) -> Tensor:
        return x if self.size == 1 else _ReduceScatterToEp.apply(x, self.group)


class _Experts(nn.Module):
    """Megatron's TEGroupedMLP weights: linear_fc1.weight<e> and linear_fc2.weight<e> per local
    expert (global index e); each fc1 TP shard holds [gate shard; up shard]."""

    def __init__(self, cfg: MoeConfig, tp: Tp, ep: Ep) -> None:
        super().__init__()
        self.linear_fc1, self.linear_fc2 = nn.Module(), nn.Module()
        for e in ep.local:
            self.linear_fc1.register_parameter(f"weight{e}", _weight(2 * cfg.expert_ffn // tp.size, cfg.hidden, 0))
        for e in ep.local:
            self.linear_fc2.register_parameter(f"weight{e}", _weight(cfg.hidden, cfg.expert_ffn // tp.size, 1))

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert e's partial output (to be summed over TP) for tokens `x`."""
        gate, up = (x @ getattr(self.linear_fc1, f"weight{e}").T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ getattr(self.linear_fc2, f"weight{e}").T


class MoeMlp(nn.Module):
    """Pre-MLP RMSNorm, top-k softmax router (replicated over TP), experts over EP and TP."""

    def __init__(self, cfg: MoeConfig, tp: Tp, ep: Ep) -> None:
        super().__init__()
        self.cfg, self.tp, self.ep = cfg, tp, ep
        self.router = _Linear(cfg.experts, cfg.hidden, None)
        self.experts = _Experts(cfg, tp, ep)

    def forward(self, h: Tensor) -> Tensor:
        cfg, shape = self.cfg, h.shape
        tokens = h.reshape(-1, shape[-1])
        probs = F.softmax(tokens @ self.router.weight.T, dim=-1, dtype=torch.float32)
        top, chosen = probs.topk(cfg.top_k, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, chosen, top / top.sum(-1, keepdim=True)).to(h.dtype)
        # copy(): each TP rank's gradient of the expert inputs and routing weights is a partial
        # sum (the experts are TP-split), summed over TP backward as for any column-parallel input
        tokens, weights = self.ep.dispatch(self.tp.copy(tokens)), self.ep.dispatch(self.tp.copy(weights))
        out = torch.zeros_like(tokens)
        for e in self.ep.local:
            rows = weights[:, e].nonzero().squeeze(-1)
            if rows.numel():
                out = out.index_add(0, rows, self.experts.expert(e, tokens[rows]) * weights[rows, e, None])
        return self.tp.reduce(self.ep.combine(out)).view(shape)


class MoeLayer(nn.Module):
    """Attention, then the pre-MLP norm and the MoE MLP."""

    def __init__(self, cfg: MoeConfig, tp: Tp, ep: Ep) -> None:
        super().__init__()
        self.self_attention = Attention(cfg, tp)
        self.pre_mlp_layernorm = nn.Module()
        self.pre_mlp_layernorm.weight = nn.Parameter(torch.ones(cfg.hidden))
        self.mlp = MoeMlp(cfg, tp, ep)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attention(x)
        return x + self.mlp(_norm(x, self.pre_mlp_layernorm.weight, self.mlp.cfg.eps))


class DenseLayer(nn.Module):
    def __init__(self, cfg: MoeConfig, tp: Tp) -> None:
        super().__init__()
        self.self_attention = Attention(cfg, tp)
        self.mlp = Mlp(cfg, tp)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attention(x)
        return x + self.mlp(x)


class MoeDecoder(nn.Module):
    def __init__(self, cfg: MoeConfig, tp: Tp, ep: Ep) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DenseLayer(cfg, tp) if i in cfg.dense_layers else MoeLayer(cfg, tp, ep) for i in range(cfg.layers)
        )
        self.final_layernorm = FinalNorm(cfg, tp)


class TinyQwen3Moe(nn.Module):
    """The model; `forward(tokens)` returns the mean next-token cross-entropy of this rank's
    tokens. `ep_group`: the EP group (None: every expert on this rank)."""

    def __init__(self, cfg: MoeConfig, tp_group: Any = None, ep_group: Any = None) -> None:
        super().__init__()
        self.cfg, self.tp, self.ep = cfg, Tp(tp_group), Ep(ep_group, cfg.experts)
        self.embedding = Embedding(cfg, self.tp)
        self.decoder = MoeDecoder(cfg, self.tp, self.ep)
        self.output_layer = OutputLayer(cfg, self.tp)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens[:, :-1])
        for layer in self.decoder.layers:
            x = layer(x)
        logits = self.output_layer(self.decoder.final_layernorm(x))
        return F.cross_entropy(logits.reshape(-1, self.cfg.vocab).float(), tokens[:, 1:].reshape(-1))


def make_ep_group(dp: int, tp: int, ep: int, timeout: Any = None) -> Any:
    """This rank's EP group (DP ranks o · ep .. o · ep + ep − 1 of its expert-DP rank o, same TP
    rank). Every rank must call it (new_group is collective)."""
    rank, mine = dist.get_rank(), None
    options = {"timeout": timeout} if timeout is not None else {}
    for t in range(tp):
        for o in range(dp // ep):
            group = dist.new_group([(o * ep + e) * tp + t for e in range(ep)], **options)
            mine = group if (rank % tp == t and (rank // tp) // ep == o) else mine
    return mine


def init_full_state(cfg: MoeConfig, seed: int = 0) -> dict[str, Tensor]:
    """Deterministic full (unsharded, canonical: fc1 rows [gate; up]) weights of every expert."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.ones_like(param)
        if param.dim() == 1
        else torch.randn(param.shape, generator=generator) / math.sqrt(param.size(1))
        for name, param in TinyQwen3Moe(cfg).named_parameters()
    }


def _expert_dim(name: str) -> int | None:
    if ".experts.linear_fc1.weight" in name:
        return 0
    return 1 if ".experts.linear_fc2.weight" in name else None


def shard_state(full: dict[str, Tensor], tp: int, tp_rank: int, local: range | None = None) -> dict[str, Tensor]:
    """TP rank `tp_rank`'s shard of canonical full weights, with only the experts in `local`
    (None: every expert)."""
    dense = {n: t for n, t in full.items() if _expert_dim(n) is None}
    out = dense_shard_state(dense, tp, tp_rank)
    for name, tensor in full.items():
        dim = _expert_dim(name)
        if dim is None or (local is not None and int(name.rsplit("weight", 1)[1]) not in local):
            continue
        if dim == 0:
            gate, up = tensor.chunk(2)
            out[name] = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]]).clone()
        else:
            out[name] = tensor.chunk(tp, dim=1)[tp_rank].clone()
    return out


def gather_state(shards: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Canonical full weights of the parameters the TP ranks' shards hold (inverse of `shard_state`)."""
    dense = [{n: t for n, t in s.items() if _expert_dim(n) is None} for s in shards]
    out = dense_gather_state(dense)
    for name in shards[0]:
        dim, parts = _expert_dim(name), [s[name] for s in shards]
        if dim == 0:
            halves = [p.chunk(2) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        elif dim == 1:
            out[name] = torch.cat(parts, dim=1)
    return out
