"""Ulysses sequence parallelism's pair: ``matmul_all_to_all`` (``all_to_all(a @ b)``, the QKV
projection's output from sequence shards to head shards) and ``all_to_all_matmul``
(``all_to_all(a) @ b``, before the output projection: head shards back to sequence shards).
Problem and layout (:mod:`.layout`), plan ops, host tasks, pricing, schedules, specs and torch
ops (docs/ulysses.md)."""

#: The modules of this package that define an op ``SPEC`` (:mod:`ficco.ops` finds them).
SPEC_MODULES = ("matmul_all_to_all", "all_to_all_matmul")
