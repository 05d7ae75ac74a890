"""Attention backends behind one ABC: torch_ref (golden reference, CPU and GPU) and triton."""
