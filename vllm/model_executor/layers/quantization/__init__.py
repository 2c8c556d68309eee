"""Weight quantization methods, applied to a loaded model (`quantize_model`)."""

from vllm.model_executor.layers.quantization.int8 import (
    QUANTIZATION_METHODS,
    Int8Linear,
    quantize_model,
)

__all__ = ["QUANTIZATION_METHODS", "Int8Linear", "quantize_model"]
