"""pagoda.kv_offload.planning."""
