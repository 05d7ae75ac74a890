"""pagoda.kernels.norm."""
