"""What an onnx bundle's compiler and executor agree on (no ONNX import: the executor loads without `onnx`)."""

from __future__ import annotations

#: bumped when the stored conventions change; the executor refuses other versions
PROGRAM_VERSION = 1
#: `TensorProto.BFLOAT16`: the ONNX element type of bfloat16 tensors handed to ORT as raw bits
ONNX_BFLOAT16 = 16
#: MatMulNBits' `accuracy_level` when the recipe names none (0: the activations stay float32)
DEFAULT_ACCURACY_LEVEL = 0
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
