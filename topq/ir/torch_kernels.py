"""Top IR's decoder-layer ops in torch, differentiable, on a batch of windows: for calibration that needs gradients
through a whole layer (AutoRound's block objective, `topq.quant.autoround_block`).

`TorchFunction` runs one program function (written, as every stage function is, for batch 1) on inputs
[B, L, ...] with the weights given per call, so a tuner can pass tensors that require gradients for the linears
it trains. The kernels follow the reference kernels (`topq.ir.reference_ops`, the semantics) in float32, or with
`linear_dtype="bf16"` the heavy products in bfloat16 (accumulated in float32): the linears' (as `topq.ir.products`
does for the numpy kernels), attention's (q, k, v rounded to bfloat16) and the MLP's gated product; norms, RoPE and
the residual stream stay float32.
tests/ir/test_torch_kernels.py compares every family's layers with the reference interpreter.

Covered are the ops of dense decoder layers (attention with GQA, soft-capping and sliding windows, gated MLPs,
norms, RoPE); a function with any other op (top.MoE's routing, linear attention's recurrences) is refused by
`uncovered_ops` / `TorchFunction`, and the caller tunes such a layer another way. The batch axis is axis 0: an op
that would move or resize it (a reshape, permute, slice or concat touching axis 0) is refused too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from topq.ir.errors import TopqError
from topq.ir.graph import Function, Module, Operation
from topq.ir.interpreter import Interpreter, Plan
from topq.ir.reference_ops import FULLY_MASKED_SCORE

__all__ = ["TorchFunction", "require_torch", "torch_kernels", "uncovered_ops"]

TorchKernel = Callable[[list[Any], dict[str, Any]], list[Any]]

#: query positions per block of `CausalAttention` (each block's scores cover only the keys up to its last position:
#: at 512 positions, 56 % of the full score matrix)
QUERY_BLOCK = 64


def require_torch() -> Any:
    """torch, or a TopqError saying it is needed."""
    try:
        import torch
    except ImportError:
        raise TopqError("gradients through a layer need torch (pip install torch)") from None
    return torch


#: a step attribute set by `keep_narrow_results`: attention returns its bf16 output as it is
NARROW_RESULT = "narrow_result"


def torch_kernels(linear_dtype: str = "f32") -> dict[str, TorchKernel]:
    """op name → torch kernel; the linears (a `top.MatMul` by a 2-D weight, `top.MLP`'s projections), attention and
    the MLP's gated product run in `linear_dtype` ("f32", or "bf16": operands rounded to bfloat16, products
    accumulated in float32, results back in float32 where they leave the op, unless `keep_narrow_results` marked the
    step). A weight given in bfloat16 is used as it is (a tuner casts it once for all its calls)."""
    torch = require_torch()
    f = torch.nn.functional
    cast = {"f32": None, "bf16": torch.bfloat16}[linear_dtype]

    def narrow(x: Any) -> Any:
        return x if cast is None else x.to(cast)

    def widen(x: Any) -> Any:
        return x if cast is None else x.to(torch.float32)

    def linear(x: Any, w: Any) -> Any:
        return widen(f.linear(narrow(x), narrow(w)))

    def gelu_tanh(x: Any) -> Any:
        return f.gelu(x, approximate="tanh")

    acts: dict[str, Callable[[Any], Any]] = {"silu": f.silu, "gelu": f.gelu, "gelu_tanh": gelu_tanh}

    def gather(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        table, idx = inputs
        if int(attrs.get("axis", 0)) != 0:
            raise TopqError("top.Gather: the torch kernels take axis 0 only")
        return [table[torch.as_tensor(idx, dtype=torch.long)]]

    def rmsnorm(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        x = inputs[0]
        w = inputs[1] if len(inputs) > 1 else None
        return [f.rms_norm(x, x.shape[-1:], w, float(attrs["eps"]))]

    def layernorm(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        x = inputs[0]
        w = inputs[1] if len(inputs) > 1 else None
        b = inputs[2] if len(inputs) > 2 else None
        return [f.layer_norm(x, x.shape[-1:], w, b, float(attrs["eps"]))]

    def matmul(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        a, b = inputs[:2]
        rt = bool(attrs.get("right_transpose", False))
        if b.dim() == 2:
            y = linear(a, b if rt else b.T)
        else:
            y = torch.matmul(a, b.transpose(-1, -2) if rt else b)
        return [y + inputs[2] if len(inputs) > 2 and inputs[2] is not None else y]

    def reshape(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        shape = [int(s) for s in attrs["shape"]]
        if not shape or shape[0] != 1:
            raise TopqError(f"top.Reshape to {shape}: the torch kernels keep axis 0 as the batch")
        return [inputs[0].reshape(inputs[0].shape[0], *shape[1:])]

    def permute(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        order = [int(o) for o in attrs["order"]]
        if order[0] != 0:
            raise TopqError(f"top.Permute {order}: the torch kernels keep axis 0 as the batch")
        return [inputs[0].permute(order)]

    def concat(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        axis = int(attrs["axis"])
        if axis % inputs[0].dim() == 0:
            raise TopqError("top.Concat along axis 0: the torch kernels keep axis 0 as the batch")
        return [torch.cat(list(inputs), dim=axis)]

    def slice_(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        x = inputs[0]
        offset, ends = attrs["offset"], attrs["ends"]
        steps = attrs.get("steps", [1] * x.dim())
        if (int(offset[0]), int(steps[0])) != (0, 1) or int(ends[0]) < 1:
            raise TopqError("top.Slice of axis 0: the torch kernels keep axis 0 as the batch")
        key = (slice(None), *(slice(int(o), int(e), int(s)) for o, e, s in zip(offset[1:], ends[1:], steps[1:])))
        return [x[key]]

    class HalvesRotation(torch.autograd.Function):  # type: ignore[name-defined]  # torch is imported lazily
        """RoPE's rotation of contiguous halves, x·cos + (−x2, x1)·sin: the reference's products and sums
        (x1 c − x2 s, x2 c + x1 s) bit for bit, and x's gradient g·cos + (g2 s2, −g1 s1) with autograd's bits. Four
        passes over x forward and three backward, where autograd's graph of the slices, negation and concatenation
        zero-fills a full tensor per slice in its backward (SmolLM2's q and k, 4 × 512 tokens, one thread: forward
        and backward 14.1 → 8.1 ms). The angles get no gradient."""

        @staticmethod
        def forward(ctx: Any, x: Any, c: Any, s: Any) -> Any:
            h = x.shape[-1] // 2
            rotated = torch.empty_like(x)
            torch.neg(x[..., h:], out=rotated[..., :h])
            rotated[..., h:] = x[..., :h]
            out = x * c
            out += rotated.mul_(s)
            ctx.save_for_backward(c, s)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, None, None]:
            c, s = ctx.saved_tensors
            h = grad.shape[-1] // 2
            through_sin = grad * s
            grad_x = grad * c
            grad_x[..., :h] += through_sin[..., h:]
            grad_x[..., h:] -= through_sin[..., :h]
            return grad_x, None, None

    def rope(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        x, cos, sin = inputs
        c, s = cos[..., None, :], sin[..., None, :]  # the same angles for every head
        r = cos.shape[-1]
        # partial rotary: the tail passes through (no slice of a full rotary: its backward zero-fills a copy)
        rotated, rest = (x, x[..., :0]) if r == x.shape[-1] else (x[..., :r], x[..., r:])
        if attrs.get("mode", "contiguous_halves") == "contiguous_halves":
            if c.requires_grad or s.requires_grad:  # HalvesRotation differentiates x only; no tuner trains angles
                raise TopqError("top.Rope: the torch kernels give no gradient to cos and sin")
            out = HalvesRotation.apply(rotated, c, s)
        else:
            xe, xo = rotated[..., 0::2], rotated[..., 1::2]
            out = torch.stack([xe * c[..., 0::2] - xo * s[..., 0::2], xo * c[..., 1::2] + xe * s[..., 1::2]],
                              dim=-1).flatten(-2)
        return [torch.cat([out, rest], dim=-1) if rest.shape[-1] else out]

    class CausalAttention(torch.autograd.Function):  # type: ignore[name-defined]  # torch is imported lazily
        """Causal self-attention of bf16 q, k, v [B, L, H, D] (GQA: q's heads in groups per k / v head) in query
        blocks of QUERY_BLOCK positions, each against only the keys it sees: scores q·kᵀ·scale and their
        gradient dO·vᵀ as float32 products of the bf16 values (exact products, float32 sums, as SDPA's bf16
        kernel accumulates), softmax in float32, P·v, Pᵀ·dO, dS·k and dSᵀ·q as bf16 products. The result is
        [B, L, H·D] in bf16. torch's CPU flash-attention kernel takes ~1.5× as long for SmolLM2's shape (4 × 512
        tokens, 9 / 3 heads, forward and backward, one thread: docs/speed.md, nineteenth round)."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, scale: float) -> Any:
            b, length, hq, d = q.shape
            hk = k.shape[2]
            g = hq // hk
            # rows (position, head of the group): a query block is a contiguous run of rows per k / v head
            q_rows = q.reshape(b, length, hk, g, d).permute(0, 2, 1, 3, 4).reshape(b, hk, length * g, d)
            qs = q_rows.to(torch.float32).mul_(scale)
            kf = k.permute(0, 2, 1, 3).to(torch.float32).contiguous()  # [B, Hk, L, D]
            vb = v.permute(0, 2, 1, 3).contiguous()
            out = torch.empty(b, hk, length * g, d, dtype=v.dtype)
            probs = []
            for a, e in _query_blocks(length):
                rows = slice(a * g, e * g)
                s = torch.matmul(qs[:, :, rows], kf[:, :, :e].transpose(-1, -2))
                s[..., a:].masked_fill_(_future(a, e, g), float("-inf"))
                p = torch.softmax(s, dim=-1)
                p_narrow = p.to(v.dtype)
                out[:, :, rows] = torch.matmul(p_narrow, vb[:, :, :e])
                probs.append((p, p_narrow))
            ctx.save_for_backward(q_rows, kf, vb, out)
            ctx.probs, ctx.scale = probs, scale
            return out.reshape(b, hk, length, g, d).permute(0, 2, 1, 3, 4).reshape(b, length, hq * d)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, Any, Any, None]:
            q_rows, kf, vb, out = ctx.saved_tensors
            b, hk, rows_all, d = q_rows.shape
            length = kf.shape[2]
            g = rows_all // length
            go = grad.reshape(b, length, hk, g, d).permute(0, 2, 1, 3, 4).reshape(b, hk, rows_all, d)
            go = go.to(vb.dtype)
            go_f = go.to(torch.float32)
            delta = (go_f * out.to(torch.float32)).sum(-1, keepdim=True)  # rowsum(dO ∘ O) = rowsum(P ∘ dP)
            k_narrow, v_f = kf.to(vb.dtype), vb.to(torch.float32)
            dq = torch.empty(b, hk, rows_all, d, dtype=torch.float32)
            dk = torch.zeros(b, hk, length, d, dtype=torch.float32)
            dv = torch.zeros(b, hk, length, d, dtype=torch.float32)
            for (a, e), (p, p_narrow) in zip(_query_blocks(length), ctx.probs):
                rows = slice(a * g, e * g)
                dv[:, :, :e] += torch.matmul(p_narrow.transpose(-1, -2), go[:, :, rows])
                dp = torch.matmul(go_f[:, :, rows], v_f[:, :, :e].transpose(-1, -2))
                ds = (dp.sub_(delta[:, :, rows]).mul_(p)).to(vb.dtype)
                dq[:, :, rows] = torch.matmul(ds, k_narrow[:, :, :e])
                dk[:, :, :e] += torch.matmul(ds.transpose(-1, -2), q_rows[:, :, rows])
            ctx.probs = None
            dq = dq.mul_(ctx.scale).reshape(b, hk, length, g, d).permute(0, 2, 1, 3, 4).reshape(b, length, hk * g, d)
            dk = dk.mul_(ctx.scale).permute(0, 2, 1, 3)
            return dq.to(vb.dtype), dk.to(vb.dtype), dv.permute(0, 2, 1, 3).to(vb.dtype), None

    def attention(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        mask = inputs[3] if len(inputs) > 3 else None
        scale = float(attrs["scale"])
        causal = bool(attrs.get("causal", True))
        softcap = float(attrs.get("softcap") or 0.0)
        window = int(attrs.get("window") or 0)
        plain = mask is None and softcap == 0 and window == 0
        q, k, v = (t.transpose(1, 2) for t in inputs[:3])  # [B, H, L, D]
        b, hq, lq, d = q.shape
        lk = k.shape[2]
        if plain and causal and lq == lk and cast is not None:
            out = CausalAttention.apply(*(narrow(t) for t in inputs[:3]), scale)
            return [out if attrs.get(NARROW_RESULT) else widen(out)]
        if plain and (lq == lk or not causal):
            out = f.scaled_dot_product_attention(narrow(q), narrow(k), narrow(v), is_causal=causal, scale=scale,
                                                 enable_gqa=True)
            out = out if attrs.get(NARROW_RESULT) else widen(out)
            return [out.transpose(1, 2).reshape(b, lq, hq * d)]
        group = hq // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = widen(torch.matmul(narrow(q), narrow(k).transpose(-1, -2))) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if mask is not None:
            scores = scores + mask
        i = torch.arange(lq)[:, None] + (lk - lq)  # bottom-right aligned: the first Lk − Lq keys are history
        j = torch.arange(lk)[None, :]
        hidden = (j > i) if causal else torch.zeros(lq, lk, dtype=torch.bool)
        if window > 0:
            hidden = hidden | ((i - j >= window) & (j >= lk - lq))
        scores = scores.masked_fill(hidden, float("-inf"))
        dead = scores.amax(-1, keepdim=True) <= FULLY_MASKED_SCORE  # as the reference: such rows give zeros
        probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
        out = torch.matmul(narrow(probs), narrow(v))
        out = out if attrs.get(NARROW_RESULT) else widen(out)
        return [out.transpose(1, 2).reshape(b, lq, hq * d)]

    # oneDNN multiplies a transposed left operand [H, B·L] markedly slower than a row-major one, and the weights'
    # gradients of the MLP are such products; the two functions below give them a row-major copy where that gives
    # autograd's bits (SmolLM2's MLP, 2,048 tokens, bf16, one thread: gate/up 6.6 → 4.1 ms each, down 7.9 → 4.7 ms;
    # for q/k/v and o the copy gives other bits, so they stay autograd's: docs/speed.md, thirteenth round)

    class SharedInputLinears(torch.autograd.Function):  # type: ignore[name-defined]  # torch is imported lazily
        """x·Wᵢᵀ for weights that read the same x (the MLP's gate and up), with autograd's products, except that
        the weights' gradients (xᵀ·gᵢ)ᵀ take xᵀ from one row-major copy. (xᵀ·g)ᵀ, not gᵀ·x: that order gives
        autograd's bits at SmolLM2's shape (1,536 × 576; checked with torch.equal on the AMX CPU)."""

        @staticmethod
        def forward(ctx: Any, x: Any, *weights: Any) -> tuple[Any, ...]:
            ctx.save_for_backward(x, *weights)
            return tuple(f.linear(x, w) for w in weights)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
            x, *weights = ctx.saved_tensors
            flat = [g.reshape(-1, g.shape[-1]) for g in grads]
            grad_x = None
            if ctx.needs_input_grad[0]:
                total = flat[0] @ weights[0]
                for g, w in zip(flat[1:], weights[1:]):
                    total = total + g @ w
                grad_x = total.reshape(x.shape)
            x_t = x.reshape(-1, x.shape[-1]).t().contiguous() if any(ctx.needs_input_grad[1:]) else None
            return (grad_x, *((x_t @ g).t() if need else None for g, need in zip(flat, ctx.needs_input_grad[1:])))

    class RowMajorGradientLinear(torch.autograd.Function):  # type: ignore[name-defined]
        """x·Wᵀ (the MLP's down projection) with autograd's products, except that W's gradient gᵀ·x takes gᵀ from a
        row-major copy. gᵀ·x, not (xᵀ·g)ᵀ: that order gives autograd's bits at
        SmolLM2's shape (576 × 1,536; as above)."""

        @staticmethod
        def forward(ctx: Any, x: Any, w: Any) -> Any:
            ctx.save_for_backward(x, w)
            return f.linear(x, w)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, Any]:
            x, w = ctx.saved_tensors
            flat = grad.reshape(-1, grad.shape[-1])
            grad_x = (flat @ w).reshape(x.shape) if ctx.needs_input_grad[0] else None
            grad_w = flat.t().contiguous() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
            return grad_x, grad_w

    def mlp(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        x, wg, wu, wd = inputs
        act = acts.get(str(attrs.get("act", "silu")))
        if act is None:
            raise TopqError(f"top.MLP: act must be one of {', '.join(acts)}, got {attrs.get('act')!r}")
        # x narrowed once for both projections; the gated product stays narrow for the down projection
        gate, up = SharedInputLinears.apply(narrow(x), narrow(wg), narrow(wu))
        return [widen(RowMajorGradientLinear.apply(act(gate) * up, narrow(wd)))]

    def unary(fn: Callable[[Any], Any]) -> TorchKernel:
        return lambda inputs, attrs: [fn(inputs[0])]

    def gelu(inputs: list[Any], attrs: dict[str, Any]) -> list[Any]:
        return [f.gelu(inputs[0], approximate=str(attrs.get("approximate", "none")))]

    return {
        "top.Gather": gather, "top.RMSNorm": rmsnorm, "top.LayerNorm": layernorm, "top.MatMul": matmul,
        "top.Add": lambda inputs, attrs: [inputs[0] + inputs[1]],
        "top.Mul": lambda inputs, attrs: [inputs[0] * inputs[1]],
        "top.MulConst": lambda inputs, attrs: [inputs[0] * float(attrs["const_val"])],
        "top.Reshape": reshape, "top.Permute": permute, "top.Concat": concat, "top.Slice": slice_,
        "top.Rope": rope, "top.FAttention": attention, "top.MLP": mlp,
        "top.SiLU": unary(f.silu), "top.Tanh": unary(torch.tanh), "top.GELU": gelu,
        "top.Sigmoid": unary(torch.sigmoid),
        "top.Softmax": lambda inputs, attrs: [torch.softmax(inputs[0], dim=int(attrs.get("axis", -1)))],
    }


#: the ops `torch_kernels` covers (besides top.Weight, whose values each call passes)
COVERED = frozenset(("top.Gather", "top.RMSNorm", "top.LayerNorm", "top.MatMul", "top.Add", "top.Mul",
                     "top.MulConst", "top.Reshape", "top.Permute", "top.Concat", "top.Slice", "top.Rope",
                     "top.FAttention", "top.MLP", "top.SiLU", "top.Tanh", "top.GELU", "top.Sigmoid",
                     "top.Softmax"))


def _query_blocks(length: int) -> list[tuple[int, int]]:
    return [(a, min(a + QUERY_BLOCK, length)) for a in range(0, length, QUERY_BLOCK)]


def _future(a: int, e: int, group: int) -> Any:
    """The keys a..e−1 a query block's rows (position, head of the group) do not see: those after the row's
    position."""
    torch = require_torch()
    positions = torch.arange(e - a).repeat_interleave(group)
    return torch.arange(e - a)[None, :] > positions[:, None]


def uncovered_ops(function: Function) -> list[str]:
    """The ops of `function` the torch kernels do not run, sorted (empty: `TorchFunction` can run it)."""
    return sorted({op.name for op in function.walk() if op.name != "top.Weight" and op.name not in COVERED})


def keep_narrow_results(plan: Plan) -> None:
    """Mark the attention steps whose output only reaches a linear (through views), which narrows it to bf16
    again: their kernels return the bf16 output as it is. The round trip is exact both ways (bf16 → float32 → bf16,
    and the gradient back), so the bits are the same, without two casts forward and two backward. An output with more
    uses keeps it (their gradients are summed in float32); k and v do not qualify, the cache reads them too."""
    uses = Counter(s for step in plan.steps for s in step.operands) + Counter(plan.outputs)
    user = {s: step for step in plan.steps for s in step.operands}
    for step in (step for step in plan.steps if step.op.name == "top.FAttention"):
        slot = step.results[0]
        while uses[slot] == 1 and slot in user:
            consumer = user[slot]
            if consumer.op.name in ("top.Reshape", "top.Permute"):
                slot = consumer.results[0]
                continue
            if consumer.op.name == "top.MatMul" and consumer.operands[0] == slot \
                    and consumer.operands[1] in plan.constants:  # x · W (+ b): the linear narrows x
                step.attrs = {**step.attrs, NARROW_RESULT: True}
            break


class _Planner(Interpreter):
    """The reference interpreter's plan of a function, with each weight slot holding the weight's name (the values
    come with every call)."""

    def load_weight(self, op: Operation) -> Any:
        return str(op.attrs["name"])


class TorchFunction:
    """`function` of `module` run by torch: `fn(inputs, weights)` with inputs [B, ...] (the function's argument
    shapes with any batch B) and `weights` name → tensor for every weight the function reads (`fn.weights`)."""

    def __init__(self, module: Module, name: str, linear_dtype: str = "f32") -> None:
        function = module[name]
        missing = uncovered_ops(function)
        if missing:
            raise TopqError(f"@{name}: the torch kernels do not run {', '.join(missing)}")
        planner = _Planner(module, lambda _: None)  # type: ignore[arg-type, return-value]
        planner.kernels = torch_kernels(linear_dtype)
        self.name = name
        self._plan = planner.plan(function)
        if linear_dtype != "f32":
            keep_narrow_results(self._plan)
        self.weights: tuple[str, ...] = tuple(dict.fromkeys(self._plan.constants.values()))  # type: ignore[arg-type]

    def __call__(self, inputs: Sequence[Any], weights: Mapping[str, Any]) -> list[Any]:
        torch = require_torch()
        plan = self._plan
        if len(inputs) != len(plan.inputs):
            raise TopqError(f"@{self.name} takes {len(plan.inputs)} inputs, got {len(inputs)}")
        env: list[Any] = [None] * plan.num_slots
        for s, value in zip(plan.inputs, inputs):
            env[s] = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        for s, weight in plan.constants.items():
            env[s] = weights[weight]  # type: ignore[index]
        for step in plan.steps:
            outs = step.kernel([env[i] for i in step.operands], step.attrs)
            for s, value in zip(step.results, outs):
                env[s] = value
        return [env[s] for s in plan.outputs]

