"""The engine: runtime, agreement, heuristics, schedules, executor, backends, kernels,
symmetric memory."""
