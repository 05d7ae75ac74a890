"""pagoda.kernels"""
