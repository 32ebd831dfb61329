"""Timing for ``characterize``: one victim op alone or beside back-to-back noise ops, on the
active backend's queues (streams on GPUs, worker threads on CPU), timed by its own events."""
from __future__ import annotations

import math
from statistics import median


class Timer:
    """Times work enqueued on backend queues with the backend's own events."""

    def __init__(self, backend, copy_queues: int):
        self.backend = backend
        self.compute = backend.queue("compute")
        self.copies = [backend.queue(f"copy{i}") for i in range(copy_queues)]

    def _drain(self):
        self.backend.finish([self.compute, *self.copies])
        self.backend.synchronize()

    def alone(self, queue, enqueue, warmup: int, repeat: int) -> float:
        """Median seconds of ``enqueue(queue)`` with every other queue idle."""
        for _ in range(warmup):
            enqueue(queue)
        self._drain()
        marks = []
        for _ in range(repeat):
            start, end = self.backend.new_event(), self.backend.new_event()
            self.backend.record(start, queue)
            enqueue(queue)
            self.backend.record(end, queue)
            marks.append((start, end))
        self._drain()
        return median(self.backend.elapsed_s(s, e) for s, e in marks)

    def beside(self, queue, enqueue, noise_queues, noise, noise_count: int, repeat: int) -> float:
        """Median seconds of ``enqueue(queue)`` while ``noise(q)`` runs ``noise_count`` times
        back to back on each of ``noise_queues`` (queued first, so it covers the victim)."""
        times = []
        for _ in range(repeat):
            for q in noise_queues:
                for _ in range(noise_count):
                    noise(q)
            start, end = self.backend.new_event(), self.backend.new_event()
            self.backend.record(start, queue)
            enqueue(queue)
            self.backend.record(end, queue)
            self._drain()
            times.append(self.backend.elapsed_s(start, end))
        return median(times)


def backend_for_characterize():
    """The active ficco backend: characterize measures the queues, copies and GEMMs that
    ficco itself runs, so where no backend can start it stops and says why."""
    from ..backends import get_backend

    return get_backend()


def noise_repeats(victim_s: float, noise_s: float) -> int:
    """Noise repetitions that outlast the victim by half again (capped: a tiny noise op
    against a long victim would otherwise queue thousands)."""
    return max(2, min(256, math.ceil(1.5 * victim_s / max(noise_s, 1e-9)) + 1))
