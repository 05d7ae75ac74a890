"""pagoda.kernels.sample."""
