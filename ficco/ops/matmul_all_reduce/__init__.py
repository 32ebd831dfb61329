"""``all_reduce(a @ b)``: its spec, torch op and schedules."""
