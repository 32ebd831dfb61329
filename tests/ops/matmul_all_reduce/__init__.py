"""matmul_all_reduce."""
