"""What an onnx bundle's compiler and executor agree on (no ONNX import: the executor loads without `onnx`)."""

from __future__ import annotations

#: bumped when the stored conventions change; the executor refuses other versions
PROGRAM_VERSION = 1
#: `TensorProto.BFLOAT16`: the ONNX element type of bfloat16 tensors handed to ORT as raw bits
ONNX_BFLOAT16 = 16
#: MatMulNBits' `accuracy_level` when the recipe names none (0: the activations stay float32)
DEFAULT_ACCURACY_LEVEL = 0
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
#: `target.attention`: `top.FAttention` as com.microsoft.GroupQueryAttention where it can express it (`auto`),
#: everywhere (`gqa`, refusing what it cannot), or as standard ops (`standard`); gqa.py, docs/onnx.md
ATTENTION_AUTO, ATTENTION_GQA, ATTENTION_STANDARD = "auto", "gqa", "standard"
ATTENTION_MODES = (ATTENTION_AUTO, ATTENTION_GQA, ATTENTION_STANDARD)
DEFAULT_ATTENTION = ATTENTION_AUTO
