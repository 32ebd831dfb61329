"""Expert parallelism: the all-to-all of tokens to their experts overlapped with the grouped
GEMM (dispatch, ``ficco.all_to_all_grouped_mm``) and its inverse (combine,
``ficco.grouped_mm_all_to_all``). FiCCO Table I's g13-g16.

- :mod:`.problem`: the routing layout of one call and the problem selectors see;
- :mod:`.routing`: counts checked on their rank, then agreed with one bounded exchange;
- :mod:`.spec`: what both op specs share (``ficco/ops/`` holds the two specs);
- :mod:`.plan_ops` and :mod:`.tasks`: count-free plan ops and the host tasks that size them
  at launch from the call's routing;
- :mod:`.library`: the torch custom ops, autograd and the public front end.

The schedules are in :mod:`ficco.schedules.all_to_all`, their prices in
:mod:`ficco.heuristics.all_to_all_pricing`.
"""
