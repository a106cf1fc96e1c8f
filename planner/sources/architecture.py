"""`Architecture`: the handful of numbers that fix a decoder-only transformer's parameter shapes.

Every model source that knows an architecture (the presets, Hugging Face configs) builds one;
`catalog.py` expands it into Megatron-core's parameters and `conventions.py` into transformers'
and torchtitan's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from canzona.planner.spec import PlanError
from canzona.schedules.limits import MAX_PARAMS


@dataclass(frozen=True)
class Architecture:
    """The numbers that determine a decoder-only transformer's parameter shapes.

    Dense fields: hidden size h, ffn, layers, heads, KV groups, head dim, vocab. MoE
    (num_experts > 0): layers with index < `first_dense_layers` or listed in `dense_layers`
    use the dense MLP of size `ffn`, all others route to `num_experts` experts of size
    `expert_ffn`, plus one fused shared-expert MLP of total size `shared_expert_ffn` when
    `num_shared_experts` > 0. MLA (kv_lora > 0): DeepSeek latent attention; `q_lora` = 0
    means queries are not compressed. For MLA models
    `num_kv_groups` equals `num_heads` and `head_dim` is qk_nope + qk_rope (informational).
    `family` is the Hugging Face `model_type` the architecture comes from (e.g. "qwen3_moe"):
    it decides details of transformers' parameter order (Mixtral registers its router first).
    """

    h: int
    ffn: int
    num_layers: int
    num_heads: int
    num_kv_groups: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    num_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    num_shared_experts: int = 0
    shared_expert_ffn: int = 0
    first_dense_layers: int = 0
    dense_layers: tuple[int, ...] = ()
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    family: str = ""

    def __post_init__(self) -> None:
        _check_field_types(self)
        for label, value in (("num_layers", self.num_layers), ("num_experts", self.num_experts)):
            if value > MAX_PARAMS:  # bounds the per-layer loops below and the expansion
                raise PlanError(f"architecture {label} {value} is above canzona's maximum of {MAX_PARAMS} parameters")
        experts = self.num_experts
        if experts and not (self.expert_ffn >= 1 and 1 <= self.top_k <= experts):
            raise PlanError(
                f"MoE architecture needs expert_ffn >= 1 and 1 <= top_k <= num_experts "
                f"(got expert_ffn {self.expert_ffn}, top_k {self.top_k}, "
                f"num_experts {self.num_experts})"
            )
        if self.num_shared_experts and self.shared_expert_ffn < 1:
            raise PlanError("shared experts need shared_expert_ffn >= 1")
        if self.has_dense_layer and self.ffn < 1:
            raise PlanError(f"dense MLP layers need ffn >= 1, got {self.ffn}")
        if self.is_mla and min(self.qk_nope + self.qk_rope, self.v_head) < 1:
            raise PlanError("MLA attention needs qk_nope + qk_rope >= 1 and v_head >= 1")

    @property
    def is_mla(self) -> bool:
        """Whether attention is DeepSeek multi-head latent attention."""
        return self.kv_lora > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a routed-expert MLP."""
        return self.num_experts > 0 and layer >= self.first_dense_layers and layer not in self.dense_layers

    @property
    def has_dense_layer(self) -> bool:
        """Whether at least one layer uses the dense MLP (so `ffn` matters)."""
        return any(not self.is_moe_layer(n) for n in range(self.num_layers))

    @property
    def has_moe_layer(self) -> bool:
        """Whether at least one layer routes to experts."""
        return any(self.is_moe_layer(n) for n in range(self.num_layers))


_POSITIVE_FIELDS = ("h", "num_layers", "num_heads", "num_kv_groups", "head_dim", "vocab")


def _check_field_types(arch: Architecture) -> None:
    # Field types are strings here (postponed annotations), hence the string comparison.
    for field in fields(arch):
        value = getattr(arch, field.name)
        if field.type == "bool" and not isinstance(value, bool):
            raise PlanError(f"architecture field {field.name} must be a boolean, got {value!r}")
        if field.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise PlanError(f"architecture field {field.name} must be an integer, got {value!r}")
        minimum = 1 if field.name in _POSITIVE_FIELDS else 0
        if field.type == "int" and value < minimum:
            raise PlanError(f"architecture field {field.name} must be >= {minimum}, got {value}")
    if not isinstance(arch.family, str):
        raise PlanError(f"architecture family must be a string, got {arch.family!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in arch.dense_layers):
        raise PlanError(f"architecture dense_layers must be layer indices: {arch.dense_layers!r}")
