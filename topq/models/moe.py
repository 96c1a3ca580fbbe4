"""Mixture-of-experts feed-forward for decoder families: reading the MoE part of a Hugging Face config into a
`MoESpec`, and building a layer's feed-forward as one `top.MoE` (sparse layers) or `top.MLP` (dense layers).

A family names its checkpoint tensors with `ExpertNames` (`{i}` the layer, `{e}` the expert) and calls
`moe_feed_forward(ctx, x, names)` in its block; everything else (routing, per-expert quantization and
calibration coverage, lowering) follows from the op.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from topq.core.errors import TopqError
from topq.core.spec import MoESpec
from topq.core.stages import named_weight
from topq.ir.top_ops import moe_operands
from topq.models.blocks import MLP_ACTIVATIONS, mlp
from topq.models.decoder import DECODER_FIELDS, hf_field, read_config

if TYPE_CHECKING:
    from topq.core.stages import BlockContext
    from topq.ir.graph import Value


#: Hugging Face hidden_act → top.MoE act
@dataclass(frozen=True)
class MoEConfig:
    """The MoE fields of Qwen2-MoE / Qwen3-MoE / Mixtral configs (each family fills what its config lacks)."""

    num_experts: int = hf_field("num_experts", "num_local_experts", default=0)
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # None: intermediate_size (Mixtral)
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: Any = ()


def read_moe(config: Mapping[str, Any], family: str, num_layers: int, intermediate_size: int, *,
             shared: bool = False, norm_topk_prob: bool | None = None) -> MoESpec | None:
    """The model's `MoESpec` (None when it has no experts). `shared`: the family has a shared expert (its size
    is read from the config); `norm_topk_prob` fixes renormalisation for families whose config does not say it."""
    cfg = read_config(MoEConfig, config, family)
    if cfg.num_experts == 0:
        return None
    step = cfg.decoder_sparse_step
    if isinstance(step, bool) or step < 1:
        raise TopqError(f"{family}: config field decoder_sparse_step={step!r} must be a positive integer")
    only = cfg.mlp_only_layers
    if not isinstance(only, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise TopqError(f"{family}: config field mlp_only_layers={only!r} must be a list of layer indices")
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return MoESpec(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                   intermediate_size=cfg.moe_intermediate_size or intermediate_size,
                   norm_topk_prob=cfg.norm_topk_prob if norm_topk_prob is None else norm_topk_prob,
                   shared_intermediate_size=cfg.shared_expert_intermediate_size if shared else 0,
                   dense_layers=dense)


#: numerics fields a MoE family implements (`ModelFamily.config_fields`): the decoder's, but experts carry no biases.
MOE_FIELDS = DECODER_FIELDS - {"mlp_bias"}
#: Qwen MoE configs carry a `sliding_window` that transformers uses only with `use_sliding_window` (left out, so
#: refused when true): the window size alone changes nothing.
QWEN_MOE_FIELDS = MOE_FIELDS | {"sliding_window"}


@dataclass(frozen=True)
class ExpertNames:
    """Checkpoint tensor names of a sparse feed-forward: `{i}` is the layer, `{e}` the expert. `shared_*` are
    the shared expert's (Qwen2-MoE), None when the family has none."""

    router: str
    gate: str
    up: str
    down: str
    shared_gate: str | None = None
    shared_up: str | None = None
    shared_down: str | None = None
    shared_expert_gate: str | None = None


#: the experts of Qwen MoE checkpoints (Qwen3-MoE), and with Qwen2-MoE's / Qwen3-Next's sigmoid-gated shared expert
QWEN_EXPERTS = ExpertNames(router="model.layers.{i}.mlp.gate.weight",
                           gate="model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
                           up="model.layers.{i}.mlp.experts.{e}.up_proj.weight",
                           down="model.layers.{i}.mlp.experts.{e}.down_proj.weight")
QWEN_SHARED_EXPERTS = replace(QWEN_EXPERTS, shared_gate="model.layers.{i}.mlp.shared_expert.gate_proj.weight",
                              shared_up="model.layers.{i}.mlp.shared_expert.up_proj.weight",
                              shared_down="model.layers.{i}.mlp.shared_expert.down_proj.weight",
                              shared_expert_gate="model.layers.{i}.mlp.shared_expert_gate.weight")


def moe_feed_forward(ctx: BlockContext, x: Value, names: ExpertNames) -> Value:
    """The layer's feed-forward: `top.MoE` on a sparse layer, the family's dense `mlp` otherwise."""
    moe = ctx.spec.moe
    if moe is None or not moe.sparse(ctx.layer):
        return mlp(ctx, x)
    act = MLP_ACTIVATIONS.get(ctx.spec.hidden_act)
    if act is None:
        raise TopqError(f"activation {ctx.spec.hidden_act!r} is not supported for experts (silu, gelu, "
                        "gelu_pytorch_tanh)")
    h, inter = ctx.spec.hidden_size, moe.intermediate_size

    def weight(template: str, shape: tuple[int, ...], expert: int = 0) -> Value:
        return named_weight(ctx.b, template.format(i=ctx.layer, e=expert), shape, ctx.shapes)

    operands = [x, weight(names.router, (moe.num_experts, h))]
    for e in range(moe.num_experts):
        operands += [weight(names.gate, (inter, h), e), weight(names.up, (inter, h), e),
                     weight(names.down, (h, inter), e)]
    if moe.shared_intermediate_size:
        if names.shared_gate is None or names.shared_up is None or names.shared_down is None \
                or names.shared_expert_gate is None:
            raise TopqError(f"family {ctx.family.name} has a shared expert size but no shared expert weights")
        s = moe.shared_intermediate_size
        operands += [weight(names.shared_gate, (s, h)), weight(names.shared_up, (s, h)),
                     weight(names.shared_down, (h, s)), weight(names.shared_expert_gate, (1, h))]
    assert len(operands) == moe_operands(moe.num_experts, bool(moe.shared_intermediate_size))
    return ctx.b.top.MoE(*operands, num_experts=moe.num_experts, top_k=moe.top_k, scoring=moe.scoring,
                         norm_topk_prob=moe.norm_topk_prob, act=act, loc="moe")
