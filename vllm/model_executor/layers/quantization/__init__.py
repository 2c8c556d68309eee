"""Weight quantization kernels, chosen per linear layer after loading (see `layers/linear`)."""

from vllm.model_executor.layers.quantization.int8 import QUANTIZATION_METHODS, Int8Linear

__all__ = ["QUANTIZATION_METHODS", "Int8Linear"]
