"""``reduce_scatter(a @ b, scatter_dim)``: its spec and schedules."""
