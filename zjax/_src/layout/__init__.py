"""Layout: the sharded storage of parameters (flat, padded, 1/N) and tensor-parallel slices."""
