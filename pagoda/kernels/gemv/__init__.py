"""pagoda.kernels.gemv.gemv."""
