"""pagoda.kernels.attention."""
