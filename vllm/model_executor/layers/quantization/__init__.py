"""Weight quantization kernels, chosen per linear layer after loading (see `layers/linear`)."""

from vllm.model_executor.layers.quantization.int8 import (
    NO_QUANTIZATION,
    QUANTIZATION_METHODS,
    Int8Linear,
)

__all__ = ["NO_QUANTIZATION", "QUANTIZATION_METHODS", "Int8Linear"]
