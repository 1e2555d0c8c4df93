"""ascend-spec: DeepSeek-style MTP speculative decoding on fixed-shape graphs."""

__version__ = "0.1.0"
