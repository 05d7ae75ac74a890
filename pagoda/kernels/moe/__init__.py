"""pagoda.kernels.moe."""
