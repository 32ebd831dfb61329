"""``all_gather(a_shard, gather_dim) @ b``: its spec and schedules."""
