"""``all_reduce(a @ b)``: its spec, torch op, pricing and schedules."""
