"""pagoda.kernels.linear_attention: the gated delta rule (GatedDeltaNet, KDA) and the
causal depthwise conv1d of hybrid linear-attention layers: torch references
(reference.py) and Triton kernels over a pool of per-sequence states."""
