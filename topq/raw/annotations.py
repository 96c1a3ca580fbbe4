"""Parameter annotations of raw kernels: `Input["tensor<?x64xf32>"]`, `InOut[...]`, `Num["f32"]`.

The frontend reads annotations from the function's source (so `from __future__ import annotations` makes no
difference); these classes only make the annotations valid Python when the module is imported. The type string
is MLIR's spelling, parsed by `topq.ir.types.parse_type`; `?` dimensions are bound from the call's operands.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from topq.ir.types import TensorType, Type


class ParamKind(Enum):
    INPUT = "Input"  # a read-only tensor operand
    INOUT = "InOut"  # a tensor the kernel writes; it becomes a result (SSA sees the writes)
    NUM = "Num"  # a scalar, fixed when the kernel is specialised (a constant in the kernel IR)


class _Annotation:
    """`Input["tensor<...>"]` evaluates to the string; what matters is the source text the frontend reads."""

    kind: ParamKind

    def __class_getitem__(cls, type_text: str) -> str:
        return type_text


class Input(_Annotation):
    kind = ParamKind.INPUT


class InOut(_Annotation):
    kind = ParamKind.INOUT


class Num(_Annotation):
    kind = ParamKind.NUM


ANNOTATIONS: dict[str, ParamKind] = {cls.__name__: cls.kind for cls in (Input, InOut, Num)}


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its name, kind and declared type (tensor dims may be `?`)."""

    name: str
    kind: ParamKind
    type: Type
    line: int

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.type, TensorType)
