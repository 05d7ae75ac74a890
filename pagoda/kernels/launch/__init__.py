"""pagoda.kernels.launch."""
