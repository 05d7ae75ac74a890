"""Quantized linear layers: the seam (base.py), the default float method, and the
schemes ``--quantization`` and checkpoints' ``quantization_config`` select."""
