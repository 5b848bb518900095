"""The floating-point configuration the suite runs under reaches the processes it starts: Ray
workers round as the driver does, so `make test-numerics` (a second configuration, see the
Makefile) changes the workers' arithmetic too, not only the driver's."""

import pytest
import ray
import torch


def fingerprint() -> tuple:
    """The kernels in use, and the bits of a matmul and a log-softmax that depend on them."""
    import os

    import torch

    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 96, generator=generator), torch.randn(96, 64, generator=generator)
    product = a @ b
    return (
        torch.backends.cpu.get_cpu_capability(),
        os.environ.get("MKL_CBWR"),
        product.numpy().tobytes(),
        torch.log_softmax(product, -1).numpy().tobytes(),
    )


@pytest.mark.numerics
def test_ray_workers_round_as_the_driver_does(shared_session):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a Ray worker runs
    try:
        assert ray.get(ray.remote(num_cpus=0)(fingerprint).remote()) == fingerprint()
    finally:
        torch.set_num_threads(threads)
