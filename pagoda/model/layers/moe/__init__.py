"""Mixture-of-experts layers: routing (routing.py), the router gate (gate.py), the
fused experts layer with its sharding weight loaders (fused_moe.py), and DeepSeek's
block of routed plus shared experts (deepseek_moe.py)."""
