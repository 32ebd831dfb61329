"""The public faces: nn, parallel, compat, integrations, torchtitan, training,
demo, selftest, bench."""
