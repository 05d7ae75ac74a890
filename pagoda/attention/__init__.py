"""Attention backends behind one ABC: torch_ref (golden reference, CPU and GPU) and triton;
for multi-head latent attention, mla_backend (plan + torch reference) and mla_triton."""
