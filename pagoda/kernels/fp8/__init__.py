"""pagoda.kernels.fp8."""
