"""matmul_reduce_scatter."""
