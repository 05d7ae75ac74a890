"""pagoda.kv_offload."""
