"""Quantization sites of a block function, found from op traits: the one site finder every scheme uses.

A *site* is one linear input: the linears that read it, the op at which it is seen when the block runs, and
the op a per-input-channel scale s of it can be folded into (AWQ and SmoothQuant divide x by s there and
multiply the linears' weight columns by s):

* `norm` — x is a normalization's output (`norm_scale` trait): divide its scale (and `norm_bias`) by s;
* `rows` — x is computed from the output rows of a linear: divide those rows (and bias) by s. Two cases:
  top.MLP's down projection reads act(x W_gᵀ)·(x W_uᵀ), linear in up's rows (`Linear.scales_input`);
  o_proj reads attention over v (`mixes_heads_of`), whose channels are v_proj's rows reshaped to heads.

Two callers group linears differently and must keep doing so (their results are stored in bundles):

* `group_sites` — the calibrated weight-only schemes (GPTQ/AWQ/AutoRound): the family's quant groups, each a
  tuple of weight names that must share one input; folds into norms with a bias and through attention.
* `shared_input_sites` — int8 (SmoothQuant): linears grouped by the value they read; the linears of one fused
  op (top.MLP) form sites of their own; folds only into norms without a bias operand (it divides no bias) and
  never through attention (it applies o_proj's factor as an explicit top.Mul).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from topq.ir.analysis import LinearUse, Users, linear_uses, op_linears, producer, users, weight_name
from topq.ir.catalogue import CATALOGUE, declared_linears, traits_of
from topq.ir.errors import TopqError
from topq.ir.graph import Function, Operation, Value

INPUT = "input"  # the site is operand `Linear.input` of its linears
MLP_HIDDEN = "mlp_hidden"  # the site is computed inside its op (top.MLP's act(x W_gᵀ)·(x W_uᵀ))


@dataclass(frozen=True)
class FoldTarget:
    """Where a per-input-channel scale s of a site can be undone (AWQ: x/s happens in the producer of x).

    kind "norm": the site is RMSNorm(x)·w (or LayerNorm): divide `weight` (and `bias`) by s.
    kind "rows": the input channels are output rows of a linear (`weight` [R, ·], `bias`): divide rows by s_r.
    `tie` maps the group's K input channels to the R producer channels when several inputs share one producer
    channel (grouped-query attention: every query head of a group reads the same value head); s must then be
    equal across tied channels, s = s_r[tie]. None means one-to-one.
    """

    kind: str
    weight: str
    bias: str | None = None
    tie: np.ndarray | None = None


@dataclass(frozen=True)
class FoldRules:
    """Which producers a caller can fold a scale into (see the module doc for who uses which)."""

    norm_bias: bool = True  # norms with a bias operand qualify (the caller divides the bias too)
    through_attention: bool = True  # o_proj's input folds into v_proj's rows through attention


@dataclass
class Site:
    names: tuple[str, ...]  # the linear weights reading this input
    op: Operation  # where the input is seen: the first of those linears to run (top.MLP for its hidden)
    kind: str  # INPUT or MLP_HIDDEN
    k: int  # input channels
    fold: FoldTarget | None
    group: int | None = None  # `group_sites`: the index of the group it was made for
    operand: int = 0  # INPUT: the operand of `op` that is the input
    expert: int | None = None  # the linears see only the tokens `op` routes to this expert (top.MoE)
    hidden_from: tuple[int, int, int] = (0, 1, 2)  # MLP_HIDDEN: the operands (x, gate, up) it is computed from


# ================================================================================ folds


def fold_target(x: Value, consumers: set[int], table: Users, rules: FoldRules) -> FoldTarget | None:
    """Where x's producer can absorb a per-channel 1/s, if anywhere (x must feed only the ops in `consumers`)."""
    if any(u is None or id(u) not in consumers for u in table.get(id(x), [])):
        return None
    op = producer(x)
    if op is None:
        return None
    traits = traits_of(op.name)
    if traits.norm_scale is not None:
        return _norm_fold(op, rules)
    if traits.mixes_heads_of is not None and rules.through_attention:
        return _attention_fold(op, traits.mixes_heads_of, table)
    return None


def _norm_fold(norm: Operation, rules: FoldRules) -> FoldTarget | None:
    traits = traits_of(norm.name)
    assert traits.norm_scale is not None
    if traits.norm_bias is not None and not rules.norm_bias:
        return None
    params = [traits.norm_scale] + ([traits.norm_bias] if traits.norm_bias is not None else [])
    if len(norm.operands) <= max(params):  # an optional scale / bias left out: nothing to divide
        return None
    weight = weight_name(norm.operands[traits.norm_scale])
    bias = weight_name(norm.operands[traits.norm_bias]) if traits.norm_bias is not None else None
    if weight is None or (traits.norm_bias is not None and bias is None):
        return None
    return FoldTarget("norm", weight, bias)


def _attention_fold(attention: Operation, operand: int, table: Users) -> FoldTarget | None:
    """o_proj's input channel (head h, dim d) is a weighted sum of value channel (h // group, d): scaling value
    row r by 1/s_r scales it exactly. Only when v comes straight from a linear, reshaped to heads."""
    if len(attention.operands) != CATALOGUE[attention.name].operands[0]:
        return None  # optional operands (a mask) present: the finders have only ever folded unmasked attention
    v = attention.operands[operand]
    reshape = producer(v)
    if reshape is None or not traits_of(reshape.name).keeps_order or len(reshape.operands) != 1:
        return None
    # v is also a block output (the KV cache): scaled values there are fine, because every stage reads the
    # cache through the same scaled v_proj / o_proj pair.
    if any(u is not attention and u is not None for u in table.get(id(v), [])) \
            or len(table.get(id(reshape.operands[0]), [])) != 1:
        return None
    linear = producer(reshape.operands[0])
    uses = list(op_linears(linear)) if linear is not None else []
    if len(uses) != 1 or uses[0].input is None or not uses[0].hf_layout:
        return None
    use = uses[0]
    bias_at = use.linear.bias
    bias = weight_name(use.op.operands[bias_at]) if bias_at is not None and len(use.op.operands) > bias_at else None
    q_head, kv_head = int(attention.attrs["q_head"]), int(attention.attrs["kv_head"])
    d = v.shape[-1]
    channel = np.arange(q_head * d)
    tie = (channel // d) // (q_head // kv_head) * d + channel % d
    return FoldTarget("rows", use.weight, bias, tie)


def _hidden_fold(use: LinearUse) -> FoldTarget | None:
    """A linear reading an activation inside its op: fold into the rows of the operand that scales it (up)."""
    at = use.linear.scales_input
    if at is None:
        return None
    return FoldTarget("rows", weight_name(use.op.operands[at]) or "")


def _operand(use: LinearUse) -> int:
    assert use.linear.input is not None
    return use.linear.input


def _hidden_k(use: LinearUse) -> int:
    return use.op.operands[use.linear.weight].shape[-1]


# ================================================================================ the two groupings


def group_sites(function: Function, groups: Sequence[tuple[str, ...]], where: Callable[[int], str],
                rules: FoldRules = FoldRules()) -> list[Site]:
    """One site per group of linear weight names (each group must share one input), in execution order.

    `where(index)` names group `index` in errors. The hidden input of a fused op is ordered just after the op's
    other inputs (it is computed inside it)."""
    uses = {use.weight: use for use in linear_uses(function)}
    table = users(function)
    order = {id(op): i for i, op in enumerate(function.ops)}
    sites = []
    for g, names in enumerate(groups):
        missing = [n for n in names if n not in uses]
        if missing:
            raise TopqError(f"quant group {where(g)}: {missing[0]} is not a linear of {function.name}")
        members = [uses[n] for n in names]
        experts = {u.linear.expert for u in members}
        if len(experts) != 1 or len({id(u.op) for u in members if u.linear.expert is not None}) > 1:
            raise TopqError(f"quant group {where(g)} of {function.name} mixes linears of different experts")
        expert = experts.pop()
        if all(u.input is None for u in members):
            first = members[0]
            sites.append(Site(names, first.op, MLP_HIDDEN, _hidden_k(first), _hidden_fold(first), g, expert=expert,
                              hidden_from=first.linear.hidden_from or (0, 1, 2)))
            continue
        inputs = {id(u.input) for u in members}
        if len(inputs) != 1 or any(u.input is None for u in members):
            raise TopqError(f"quant group {where(g)} of {function.name} does not share one input")
        ops = {id(u.op): u.op for u in members}
        first_use = min(members, key=lambda u: order[id(u.op)])
        x = first_use.input
        assert x is not None
        # A scale folded into x's producer reaches every reader of x inside those ops: only when the group holds
        # all of them, and never for routed experts (x also feeds the router and the other experts).
        readers = {use.weight for op in ops.values() for use in op_linears(op) if use.input is x}
        fold = fold_target(x, set(ops), table, rules) if readers <= set(names) and expert is None else None
        sites.append(Site(names, first_use.op, INPUT, x.shape[-1], fold, g, _operand(first_use), expert=expert))
    sites.sort(key=lambda s: order[id(s.op)] + (0.5 if s.kind == MLP_HIDDEN else 0))
    return sites


def shared_input_sites(function: Function, accept: Callable[[LinearUse], bool],
                       rules: FoldRules = FoldRules(norm_bias=False, through_attention=False)) -> list[Site]:
    """Sites of the accepted linears: those of one fused op (several linears) first, in op order, each op's own
    input then its hidden one; then the single-linear ops grouped by the value they read, in order of first use.

    A fused op counts only when every linear of it is accepted (it is then rewritten as a whole)."""
    table = users(function)
    by_input: dict[int, tuple[Value, list[LinearUse]]] = {}
    sites: list[Site] = []
    for op in function.ops:
        declared = declared_linears(op.name, len(op.operands))
        if not declared:
            continue
        uses = list(op_linears(op))
        if len(declared) == 1:
            if uses and accept(uses[0]) and uses[0].input is not None:
                x = uses[0].input
                by_input.setdefault(id(x), (x, []))[1].append(uses[0])
            continue
        if len(uses) != len(declared) or not all(accept(u) for u in uses):
            continue
        own: dict[int, tuple[Value, list[LinearUse]]] = {}  # the op's linears by the operand they read
        for u in uses:
            if u.input is not None:
                own.setdefault(id(u.input), (u.input, []))[1].append(u)
        for x, members in own.values():
            sites.append(Site(tuple(u.weight for u in members), op, INPUT, x.shape[-1],
                              fold_target(x, {id(op)}, table, rules), operand=_operand(members[0])))
        for u in uses:
            if u.input is None:
                sites.append(Site((u.weight,), op, MLP_HIDDEN, _hidden_k(u), _hidden_fold(u)))
    for x, members in by_input.values():
        ops = {id(u.op) for u in members}
        sites.append(Site(tuple(u.weight for u in members), members[0].op, INPUT, x.shape[-1],
                          fold_target(x, ops, table, rules), operand=_operand(members[0])))
    return sites
