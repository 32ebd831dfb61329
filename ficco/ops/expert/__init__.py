"""Expert parallelism's pair, dispatch (``all_to_all_grouped_mm``) and combine
(``grouped_mm_all_to_all``): specs, problem, routing, plan ops, host tasks, pricing, torch ops
and schedules."""

#: The modules of this package that define an op ``SPEC`` (:mod:`ficco.ops` finds them).
SPEC_MODULES = ("dispatch", "combine")
