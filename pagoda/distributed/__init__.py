"""pagoda.distributed: the tensor-parallel process group and its collectives."""
