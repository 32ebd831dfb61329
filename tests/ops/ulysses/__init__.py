"""The Ulysses pair: matmul_all_to_all and all_to_all_matmul."""
