"""Put on PYTHONPATH with ``FICCO_FAKE_GPU=cuda:8`` (vendor:hardware queues): every Python
process started then (a script's parts, their spawned ranks) runs ficco on the fake GPU of
tests/fake_gpu.py. tests/claims/test_gpu_lease.py runs the lease scripts so."""
import os
import sys

if os.environ.get("FICCO_FAKE_GPU"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))
    import ficco
    from tests import fake_gpu

    vendor, _, queues = os.environ["FICCO_FAKE_GPU"].partition(":")
    fake_gpu.install(vendor, int(queues or 8))
    real_shutdown = ficco.shutdown

    def shutdown():
        """ficco.shutdown() closes the backend: the fake one comes back, as a GPU's would."""
        real_shutdown()
        fake_gpu.ensure(vendor, int(queues or 8))

    ficco.shutdown = shutdown
