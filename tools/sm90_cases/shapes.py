"""What the sm_90 compile cases share: the target's capability (the kernel families'
configs for Hopper) and the Qwen3-30B-A3B widths of the batch-1 decode cases."""

import torch

HOPPER = (9, 0)
BF16 = torch.bfloat16
HIDDEN, QKV_ROWS, EXPERTS, EXPERT_INTER = 2048, 5120, 128, 768  # Qwen3-30B-A3B
