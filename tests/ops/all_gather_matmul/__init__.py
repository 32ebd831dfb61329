"""all_gather_matmul: end to end, its gated schedules."""
