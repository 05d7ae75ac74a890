"""Workers: the model runner, its persistent per-request state, KV cache tensors."""
