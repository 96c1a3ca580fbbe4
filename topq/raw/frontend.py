"""The raw-kernel frontend: a Python function's AST → kernel IR (see `kernel_ops.py`).

Nothing of the user's code is executed: the source is read with `inspect.getsource` and walked with `ast`.
Python locals become SSA values — a variable reassigned inside a loop becomes an `scf.for` iter_arg, one
reassigned inside an `if` becomes an `scf.if` result — and tensor parameters become buffers accessed with
`memref.load` / `memref.store`. Literals stay untyped (`Lit`) until an operation gives them a type, as in
Python: `v / 2` on an f32 `v` is an f32 division, `range(2)` counts in `index`.

Anything outside the subset is a `TopqError` "FILE:LINE: unsupported construct: WHAT".
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from topq.core.errors import TopqError
from topq.ir.builder import Builder
from topq.ir.graph import Block, Operation, Region, Value
from topq.ir.types import ScalarType, TensorType, Type, TypeParseError, parse_type
from topq.raw.annotations import ANNOTATIONS, Param, ParamKind
from topq.raw.functions import MATH_CALLS
from topq.raw.kernel_ops import FLOAT_TYPES, I1, INDEX

_UNSUPPORTED_NAMES: dict[type, str] = {
    ast.While: "while loop", ast.ListComp: "list comprehension", ast.SetComp: "set comprehension",
    ast.DictComp: "dict comprehension", ast.GeneratorExp: "generator expression", ast.Lambda: "lambda",
    ast.With: "with statement", ast.Try: "try statement", ast.Break: "break", ast.Continue: "continue",
    ast.FunctionDef: "nested function", ast.ClassDef: "class definition", ast.Raise: "raise",
    ast.Assert: "assert", ast.Global: "global statement", ast.Nonlocal: "nonlocal statement",
    ast.Delete: "del statement", ast.Import: "import", ast.ImportFrom: "import", ast.List: "list",
    ast.Tuple: "tuple", ast.Dict: "dict", ast.Set: "set", ast.JoinedStr: "f-string", ast.NamedExpr: "walrus (:=)",
    ast.Starred: "starred expression", ast.Slice: "slice", ast.Await: "await", ast.Yield: "yield",
    ast.Match: "match statement",
}
_BINARY_FLOAT = {ast.Add: "arith.addf", ast.Sub: "arith.subf", ast.Mult: "arith.mulf", ast.Div: "arith.divf"}
_BINARY_INT = {ast.Add: "arith.addi", ast.Sub: "arith.subi", ast.Mult: "arith.muli", ast.FloorDiv: "arith.floordivsi"}
_CMP_FLOAT = {ast.Lt: "olt", ast.LtE: "ole", ast.Gt: "ogt", ast.GtE: "oge", ast.Eq: "oeq", ast.NotEq: "une"}
_CMP_INT = {ast.Lt: "slt", ast.LtE: "sle", ast.Gt: "sgt", ast.GtE: "sge", ast.Eq: "eq", ast.NotEq: "ne"}


@dataclass(frozen=True)
class Lit:
    """A Python literal (or `x.shape[d]`) not yet given an IR type; `int` becomes index or a float by context."""

    value: int | float | bool


Scalar = Value | Lit


@dataclass(frozen=True)
class KernelSource:
    """Where a kernel's definition lives: its AST, file and the line offset of the function."""

    tree: ast.FunctionDef
    path: str
    line_offset: int
    globals: dict[str, Any]

    def where(self, node: ast.AST | None) -> str:
        line = self.line_offset + getattr(node, "lineno", 1)
        return f"{self.path}:{line}"

    def loc(self, node: ast.AST) -> str:
        return f"{os.path.basename(self.path)}:{self.line_offset + getattr(node, 'lineno', 1)}"

    def fail(self, node: ast.AST | None, message: str) -> TopqError:
        return TopqError(f"{self.where(node)}: {message}")

    def unsupported(self, node: ast.AST, what: str | None = None) -> TopqError:
        return self.fail(node, f"unsupported construct: {what or _describe(node)}")


def _describe(node: ast.AST) -> str:
    return _UNSUPPORTED_NAMES.get(type(node), type(node).__name__)


def read_source(fn: Callable[..., Any]) -> KernelSource:
    """Parse the source of `fn` (a plain module-level or nested function)."""
    try:
        path = inspect.getsourcefile(fn) or "<unknown>"
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError) as exc:
        raise TopqError(f"@kernel {getattr(fn, '__qualname__', fn)!r}: cannot read its source ({exc})") from None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise TopqError(f"{path}:{first}: @kernel applies to a function definition")
    # Line numbers in the parsed snippet start at 1 on its first line (the decorator).
    return KernelSource(fdef, path, first - 1, getattr(fn, "__globals__", {}))


def parse_params(src: KernelSource) -> list[Param]:
    """The annotated parameters: each `name: Input["tensor<...>"] | InOut["tensor<...>"] | Num["f32"]`."""
    args = src.tree.args
    for extra, what in ((args.vararg, "*args"), (args.kwarg, "**kwargs")):
        if extra is not None:
            raise src.unsupported(extra, what)
    if args.posonlyargs or args.kwonlyargs or args.defaults or args.kw_defaults:
        raise src.unsupported(src.tree, "positional-only, keyword-only or default parameters")
    params: list[Param] = []
    for arg in args.args:
        params.append(_param(src, arg))
    if not any(p.kind is ParamKind.INOUT for p in params):
        raise src.fail(src.tree, f"kernel {src.tree.name!r} has no InOut parameter, so it computes nothing")
    return params


def _param(src: KernelSource, arg: ast.arg) -> Param:
    note = arg.annotation
    if isinstance(note, ast.Constant) and isinstance(note.value, str):  # a string annotation: parse it
        note = ast.parse(note.value, mode="eval").body
        ast.copy_location(note, arg)
    kind_node = note.value if isinstance(note, ast.Subscript) else None
    kind_name = kind_node.id if isinstance(kind_node, ast.Name) else (
        kind_node.attr if isinstance(kind_node, ast.Attribute) else None)
    if not isinstance(note, ast.Subscript) or kind_name not in ANNOTATIONS:
        raise src.fail(arg, f"parameter {arg.arg!r} needs an annotation Input[\"tensor<...>\"], "
                            f"InOut[\"tensor<...>\"] or Num[\"f32\"]")
    text = note.slice
    if not (isinstance(text, ast.Constant) and isinstance(text.value, str)):
        raise src.fail(arg, f"parameter {arg.arg!r}: the type in {kind_name}[...] must be a string such as "
                            f"\"tensor<?x64xf32>\"")
    try:
        type_ = parse_type(text.value)
    except TypeParseError as exc:
        raise src.fail(arg, f"parameter {arg.arg!r}: {exc}") from None
    kind = ANNOTATIONS[kind_name]
    if (kind is ParamKind.NUM) == isinstance(type_, TensorType):
        want = "a scalar type such as f32" if kind is ParamKind.NUM else "a tensor type"
        raise src.fail(arg, f"parameter {arg.arg!r}: {kind_name} needs {want}, got {type_}")
    if kind is ParamKind.NUM and type_.name not in FLOAT_TYPES | {"index"}:
        raise src.fail(arg, f"parameter {arg.arg!r}: Num must be a float type or index, got {type_}")
    return Param(arg.arg, kind, type_, src.line_offset + arg.lineno)


def assigned_names(body: Iterable[ast.stmt]) -> list[str]:
    """Names a statement list assigns (in source order), looking into nested ifs and loops but not loop targets."""
    names: dict[str, None] = {}

    def visit(stmts: Iterable[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        names[t.id] = None
            elif isinstance(s, ast.For):
                visit(s.body)
            elif isinstance(s, ast.If):
                visit(s.body)
                visit(s.orelse)

    visit(body)
    return list(names)


class Lowering:
    """Lower one kernel, specialised to static operand types and Num values, into a Block."""

    def __init__(self, src: KernelSource, params: Sequence[Param], types: dict[str, Type],
                 nums: dict[str, int | float], arg_order: Sequence[str]) -> None:
        self.src = src
        self.params = {p.name: p for p in params}
        self.nums = nums
        self.block = Block()
        self.b = Builder()
        self.buffers: dict[str, Value] = {name: self.block.add_arg(types[name]) for name in arg_order}
        floats = [t.dtype for t in types.values() if isinstance(t, TensorType) and t.dtype in FLOAT_TYPES]
        self.float_type = ScalarType(floats[0] if floats else "f32")

    def lower(self) -> Block:
        body = list(self.src.tree.body)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        if body and isinstance(body[-1], ast.Return) and body[-1].value is None:
            body = body[:-1]  # a trailing bare `return`
        with self.b.at(self.block):
            self.statements(body, {})
        return self.block

    # -- emission helpers --------------------------------------------------------------------------------
    def emit(self, node: ast.AST, name: str, operands: Sequence[Value], result_types: Sequence[Type],
             attrs: dict[str, Any] | None = None, regions: list[Region] | None = None) -> Operation:
        return self.b.create(name, operands, attrs or {}, result_types, regions, loc=self.src.loc(node))

    def constant(self, node: ast.AST, value: int | float | bool, type_: ScalarType) -> Value:
        if type_.name in FLOAT_TYPES:
            if isinstance(value, bool):
                raise self.src.fail(node, f"a boolean used as {type_}")
            stored: int | float = float(value)
        elif type_ == I1:
            if not isinstance(value, bool):
                raise self.src.fail(node, f"{value!r} used as a condition; compare it instead")
            stored = int(value)
        else:
            if not isinstance(value, int) or isinstance(value, bool):
                raise self.src.fail(node, f"{value!r} used as {type_} (an integer is needed)")
            stored = value
        return self.emit(node, "arith.constant", [], [type_], {"value": stored}).result

    def to_type(self, node: ast.AST, x: Scalar, type_: ScalarType) -> Value:
        """`x` as a value of `type_`: literals become constants, integers convert to floats."""
        if isinstance(x, Lit):
            value = x.value
            if type_.name in FLOAT_TYPES and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            return self.constant(node, value, type_)
        have = x.type
        if have == type_:
            return x
        if type_.name in FLOAT_TYPES and have.name in ("index", "i64", "i32"):
            if have == INDEX:
                x = self.emit(node, "arith.index_cast", [x], [ScalarType("i64")]).result
            return self.emit(node, "arith.sitofp", [x], [type_]).result
        if type_ == INDEX and have.name in ("i64", "i32"):
            return self.emit(node, "arith.index_cast", [x], [INDEX]).result
        raise self.src.fail(node, f"a {have} value is used where {type_} is needed")

    def typed(self, node: ast.AST, x: Scalar) -> Value:
        """A literal given its default type (int → index, float → the kernel's float type, bool → i1)."""
        if isinstance(x, Value):
            return x
        if isinstance(x.value, bool):
            return self.constant(node, x.value, I1)
        return self.constant(node, x.value, INDEX if isinstance(x.value, int) else self.float_type)

    def common_type(self, node: ast.AST, a: Scalar, b: Scalar) -> ScalarType:
        """The type binary arithmetic or a comparison of `a` and `b` happens in (Python's promotion rules)."""
        kinds = []
        for x in (a, b):
            if isinstance(x, Lit):
                kinds.append(I1 if isinstance(x.value, bool) else "int" if isinstance(x.value, int) else "float")
            else:
                kinds.append(x.type)
        if I1 in kinds:
            raise self.src.fail(node, "arithmetic on a condition (i1) value")
        typed = [k for k in kinds if isinstance(k, ScalarType)]
        floats = [k for k in typed if k.name in FLOAT_TYPES]
        if len({f.name for f in floats}) > 1:
            raise self.src.fail(node, f"mixed float types {floats[0]} and {floats[1]}")
        if floats:
            return floats[0]
        if "float" in kinds:
            return self.float_type
        return typed[0] if typed else INDEX

    # -- statements --------------------------------------------------------------------------------------
    def statements(self, stmts: Iterable[ast.stmt], env: dict[str, Scalar]) -> None:
        for s in stmts:
            self.statement(s, env)

    def statement(self, s: ast.stmt, env: dict[str, Scalar]) -> None:
        if isinstance(s, ast.Assign):
            if len(s.targets) != 1:
                raise self.src.unsupported(s, "chained assignment")
            self.assign(s, s.targets[0], self.expr(s.value, env), env)
        elif isinstance(s, ast.AnnAssign) and s.value is not None:
            self.assign(s, s.target, self.expr(s.value, env), env)
        elif isinstance(s, ast.AugAssign):
            current = self.expr(_as_load(s.target), env)
            self.assign(s, s.target, self.binary(s, s.op, current, self.expr(s.value, env)), env)
        elif isinstance(s, ast.For):
            self.for_loop(s, env)
        elif isinstance(s, ast.If):
            self.if_statement(s, env)
        elif isinstance(s, ast.Pass):
            pass
        elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str):
            pass  # a string used as a comment
        elif isinstance(s, ast.Return):
            raise self.src.unsupported(s, "return (InOut parameters are the results; only a final bare return)")
        elif isinstance(s, ast.Expr):
            raise self.src.unsupported(s, f"expression statement ({_describe(s.value)})")
        else:
            raise self.src.unsupported(s)

    def assign(self, s: ast.stmt, target: ast.expr, value: Scalar, env: dict[str, Scalar]) -> None:
        if isinstance(target, ast.Name):
            if target.id in self.params:
                raise self.src.fail(s, f"cannot assign to parameter {target.id!r}")
            env[target.id] = value
        elif isinstance(target, ast.Subscript):
            buffer, indices, param = self.subscript(target, env)
            if param.kind is not ParamKind.INOUT:
                raise self.src.fail(s, f"cannot write to {param.kind.value} parameter {param.name!r} "
                                       f"(only InOut parameters are written)")
            element = ScalarType(buffer.type.dtype)
            stored = self.to_type(s, value, element)
            self.emit(s, "memref.store", [stored, buffer, *indices], [])
        else:
            raise self.src.unsupported(s, f"assignment to a {_describe(target)}")

    def for_loop(self, s: ast.For, env: dict[str, Scalar]) -> None:
        if s.orelse:
            raise self.src.unsupported(s, "for-else")
        if not isinstance(s.target, ast.Name):
            raise self.src.unsupported(s.target, "loop target other than a single name")
        it = s.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"):
            raise self.src.unsupported(it, "for loop over something other than range(...)")
        if it.keywords or not 1 <= len(it.args) <= 3:
            raise self.src.unsupported(it, "range() with keywords or more than 3 arguments")
        bounds = [self.expr(a, env) for a in it.args]
        if len(bounds) == 1:
            bounds = [Lit(0), bounds[0]]
        if len(bounds) == 2:
            bounds.append(Lit(1))
        if isinstance(bounds[2], Lit) and not (isinstance(bounds[2].value, int) and bounds[2].value > 0):
            raise self.src.fail(it, "range() step must be a positive integer")
        lb, ub, step = (self.to_type(it, x, INDEX) for x in bounds)
        carried = [n for n in assigned_names(s.body) if n in env and n != s.target.id]
        inits = [self.typed(s, env[n]) for n in carried]
        body = Block()
        inner: dict[str, Scalar] = dict(env)
        inner[s.target.id] = body.add_arg(INDEX)
        for name, init in zip(carried, inits):
            inner[name] = body.add_arg(init.type)
        with self.b.at(body):
            self.statements(s.body, inner)
            nexts = []
            for name, init in zip(carried, inits):
                value = inner[name]
                if isinstance(value, Value) and value.type != init.type:
                    raise self.src.fail(s, f"loop-carried variable {name!r} changes type from {init.type} to "
                                           f"{value.type}; start it with a value of the final type (e.g. 0.0)")
                nexts.append(self.to_type(s, value, init.type))
            self.emit(s, "scf.yield", nexts, [])
        op = self.emit(s, "scf.for", [lb, ub, step, *inits], [v.type for v in inits], regions=[Region([body])])
        for name, result in zip(carried, op.results):
            env[name] = result

    def if_statement(self, s: ast.If, env: dict[str, Scalar]) -> None:
        cond = self.condition(s.test, env)
        branches = []
        for stmts in (s.body, s.orelse):
            block, scope = Block(), dict(env)
            with self.b.at(block):
                self.statements(stmts, scope)
            branches.append((block, scope))
        (then_block, then_env), (else_block, else_env) = branches
        merged: list[str] = []
        for name in assigned_names([*s.body, *s.orelse]):
            if name not in then_env or name not in else_env:
                env.pop(name, None)  # defined on one path only: not usable after the if
            elif then_env[name] is else_env[name] or (isinstance(then_env[name], Lit) and
                                                     then_env[name] == else_env[name]):
                env[name] = then_env[name]
            else:
                merged.append(name)
        types = [self.common_type(s, then_env[n], else_env[n]) if _is_arith(then_env[n], else_env[n])
                 else self._yield_type(s, n, then_env[n], else_env[n]) for n in merged]
        for block, scope in branches:
            with self.b.at(block):
                self.emit(s, "scf.yield", [self.to_type(s, scope[n], t) for n, t in zip(merged, types)], [])
        op = self.emit(s, "scf.if", [cond], types, regions=[Region([then_block]), Region([else_block])])
        for name, result in zip(merged, op.results):
            env[name] = result

    def _yield_type(self, node: ast.AST, name: str, a: Scalar, b: Scalar) -> ScalarType:
        ta, tb = (x.type if isinstance(x, Value) else self.typed(node, x).type for x in (a, b))
        if ta != tb:
            raise self.src.fail(node, f"variable {name!r} is {ta} in one branch and {tb} in the other")
        return ta  # type: ignore[return-value]

    # -- expressions -------------------------------------------------------------------------------------
    def expr(self, e: ast.expr, env: dict[str, Scalar]) -> Scalar:
        if isinstance(e, ast.Constant):
            if isinstance(e.value, (bool, int, float)):
                return Lit(e.value)
            raise self.src.unsupported(e, f"constant {e.value!r}")
        if isinstance(e, ast.Name):
            return self.name(e, env)
        if isinstance(e, ast.BinOp):
            return self.binary(e, e.op, self.expr(e.left, env), self.expr(e.right, env))
        if isinstance(e, ast.UnaryOp):
            return self.unary(e, env)
        if isinstance(e, (ast.Compare, ast.BoolOp)):
            return self.condition(e, env)
        if isinstance(e, ast.IfExp):
            cond = self.condition(e.test, env)
            a, b = self.expr(e.body, env), self.expr(e.orelse, env)
            t = self.common_type(e, a, b) if _is_arith(a, b) else self._yield_type(e, "<if-expression>", a, b)
            return self.emit(e, "arith.select", [cond, self.to_type(e, a, t), self.to_type(e, b, t)], [t]).result
        if isinstance(e, ast.Call):
            return self.call(e, env)
        if isinstance(e, ast.Subscript):
            shape_dim = self.shape_dim(e)
            if shape_dim is not None:
                return Lit(shape_dim)
            buffer, indices, _ = self.subscript(e, env)
            return self.emit(e, "memref.load", [buffer, *indices], [ScalarType(buffer.type.dtype)]).result
        if isinstance(e, ast.Attribute):
            raise self.src.unsupported(e, f"attribute access .{e.attr} (only x.shape[d] is supported)")
        raise self.src.unsupported(e)

    def name(self, e: ast.Name, env: dict[str, Scalar]) -> Scalar:
        if e.id in env:
            return env[e.id]
        param = self.params.get(e.id)
        if param is not None:
            if param.kind is ParamKind.NUM:
                return self.constant(e, self.nums[e.id], param.type)  # type: ignore[arg-type]
            raise self.src.fail(e, f"tensor parameter {e.id!r} used as a scalar; index it, e.g. {e.id}[i]")
        value = self.src.globals.get(e.id)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return Lit(value)  # a module-level numeric constant
        raise self.src.fail(e, f"name {e.id!r} is not defined in the kernel (or only inside a loop or one branch)")

    def binary(self, e: ast.AST, op: ast.operator, a: Scalar, b: Scalar) -> Value:
        t = self.common_type(e, a, b)
        if isinstance(op, ast.Div) and t.name not in FLOAT_TYPES:
            t = self.float_type  # Python's true division of integers gives a float
        table = _BINARY_FLOAT if t.name in FLOAT_TYPES else _BINARY_INT
        name = table.get(type(op))
        if name is None:
            raise self.src.unsupported(e, f"operator {_OPERATOR_TEXT.get(type(op), type(op).__name__)} on {t}")
        return self.emit(e, name, [self.to_type(e, a, t), self.to_type(e, b, t)], [t]).result

    def unary(self, e: ast.UnaryOp, env: dict[str, Scalar]) -> Scalar:
        if isinstance(e.op, ast.Not):
            cond = self.condition(e.operand, env)
            return self.emit(e, "arith.xori", [cond, self.constant(e, True, I1)], [I1]).result
        x = self.expr(e.operand, env)
        if isinstance(e.op, ast.UAdd):
            return x
        if isinstance(e.op, ast.USub):
            if isinstance(x, Lit) and not isinstance(x.value, bool):
                return Lit(-x.value)
            t = self.common_type(e, x, x)
            if t.name in FLOAT_TYPES:
                return self.emit(e, "arith.negf", [self.to_type(e, x, t)], [t]).result
            return self.emit(e, "arith.subi", [self.constant(e, 0, t), self.to_type(e, x, t)], [t]).result
        raise self.src.unsupported(e, "operator ~")

    def condition(self, e: ast.expr, env: dict[str, Scalar]) -> Value:
        """An i1 value: a comparison, `and`/`or`/`not` of conditions, or a variable holding one."""
        if isinstance(e, ast.Compare):
            if len(e.ops) != 1:
                raise self.src.unsupported(e, "chained comparison")
            a, b = self.expr(e.left, env), self.expr(e.comparators[0], env)
            t = self.common_type(e, a, b)
            floating = t.name in FLOAT_TYPES
            predicate = (_CMP_FLOAT if floating else _CMP_INT).get(type(e.ops[0]))
            if predicate is None:
                raise self.src.unsupported(e, f"comparison {type(e.ops[0]).__name__}")
            return self.emit(e, "arith.cmpf" if floating else "arith.cmpi",
                             [self.to_type(e, a, t), self.to_type(e, b, t)], [I1], {"predicate": predicate}).result
        if isinstance(e, ast.BoolOp):
            name = "arith.andi" if isinstance(e.op, ast.And) else "arith.ori"
            result = self.condition(e.values[0], env)
            for more in e.values[1:]:  # both sides are evaluated: kernel conditions have no side effects
                result = self.emit(e, name, [result, self.condition(more, env)], [I1]).result
            return result
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return self.unary(e, env)  # type: ignore[return-value]
        x = self.expr(e, env)
        if isinstance(x, Lit) and isinstance(x.value, bool):
            return self.constant(e, x.value, I1)
        if isinstance(x, Value) and x.type == I1:
            return x
        raise self.src.fail(e, "a condition must be a comparison (e.g. v > 0.0), not a number")

    def call(self, e: ast.Call, env: dict[str, Scalar]) -> Scalar:
        func = e.func
        if isinstance(func, ast.Name):
            fname = func.id
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            fname = func.attr  # math.exp, np.exp, raw.exp
        else:
            raise self.src.unsupported(e, "call of a computed function")
        if e.keywords or any(isinstance(a, ast.Starred) for a in e.args):
            raise self.src.unsupported(e, f"call to {fname}() with keywords or *args")
        args = [self.expr(a, env) for a in e.args]
        if fname in MATH_CALLS or fname == "abs":
            self._arity(e, fname, args, 1)
            t = self.common_type(e, args[0], Lit(0.0))
            op = "math.absf" if fname == "abs" else MATH_CALLS[fname]
            return self.emit(e, op, [self.to_type(e, args[0], t)], [t]).result
        if fname in ("max", "min"):
            self._arity(e, fname, args, 2)
            t = self.common_type(e, args[0], args[1])
            floating = t.name in FLOAT_TYPES
            op = {("max", True): "arith.maximumf", ("min", True): "arith.minimumf",
                  ("max", False): "arith.maxsi", ("min", False): "arith.minsi"}[fname, floating]
            return self.emit(e, op, [self.to_type(e, a, t) for a in args], [t]).result
        if fname == "float":
            self._arity(e, fname, args, 1)
            return self.to_type(e, args[0], self.common_type(e, args[0], Lit(0.0)))
        raise self.src.unsupported(e, f"call to unknown function {fname!r}")

    def _arity(self, e: ast.Call, fname: str, args: list[Scalar], n: int) -> None:
        if len(args) != n:
            raise self.src.fail(e, f"{fname}() takes {n} argument(s) in a kernel, got {len(args)}")

    def shape_dim(self, e: ast.Subscript) -> int | None:
        """`x.shape[d]` of a tensor parameter → its static size, else None."""
        v = e.value
        if not (isinstance(v, ast.Attribute) and v.attr == "shape" and isinstance(v.value, ast.Name)):
            return None
        buffer = self.buffers.get(v.value.id)
        if buffer is None:
            raise self.src.fail(e, f"{v.value.id!r} is not a tensor parameter")
        d = e.slice
        if not (isinstance(d, ast.Constant) and isinstance(d.value, int) and not isinstance(d.value, bool)):
            raise self.src.unsupported(e, "x.shape[...] with a non-constant dimension")
        shape = buffer.type.shape
        if not -len(shape) <= d.value < len(shape):
            raise self.src.fail(e, f"{v.value.id}.shape[{d.value}]: {v.value.id} has rank {len(shape)}")
        return shape[d.value]

    def subscript(self, e: ast.Subscript, env: dict[str, Scalar]) -> tuple[Value, list[Value], Param]:
        if not isinstance(e.value, ast.Name) or e.value.id not in self.buffers:
            raise self.src.unsupported(e, "subscript of something other than a tensor parameter")
        name = e.value.id
        buffer = self.buffers[name]
        items = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
        for item in items:
            if isinstance(item, ast.Slice):
                raise self.src.unsupported(item, "slice (index one element at a time)")
        if len(items) != buffer.type.rank:
            raise self.src.fail(e, f"{name} has rank {buffer.type.rank}, indexed with {len(items)} subscript(s)")
        indices = [self.to_type(item, self.expr(item, env), INDEX) for item in items]
        return buffer, indices, self.params[name]


_OPERATOR_TEXT = {ast.Mod: "%", ast.Pow: "**", ast.FloorDiv: "//", ast.MatMult: "@", ast.BitAnd: "&",
                  ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>", ast.Div: "/"}


def _is_arith(a: Scalar, b: Scalar) -> bool:
    """True unless one side is a condition (which must match exactly instead of being promoted)."""
    return not any((isinstance(x, Value) and x.type == I1) or (isinstance(x, Lit) and isinstance(x.value, bool))
                   for x in (a, b))


def _as_load(target: ast.expr) -> ast.expr:
    """The target of `x += v` read as an expression."""
    copy = ast.fix_missing_locations(ast.copy_location(
        ast.Subscript(target.value, target.slice, ast.Load()) if isinstance(target, ast.Subscript)
        else ast.Name(target.id, ast.Load()) if isinstance(target, ast.Name) else target, target))
    return copy
