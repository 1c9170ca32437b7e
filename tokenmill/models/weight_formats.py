"""The in-memory weight formats (models/quant.py runs them), apart from quant.py so that reading
them, to build command-line flags, does not import torch."""

WEIGHT_FORMATS = ("auto", "fp32", "q8", "q4")
