"""Fixtures shared by the tests of ``lightning_energy``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tests.lightning_energy.processes import free_port


@pytest.fixture
def single_process_group() -> Iterator[None]:
    """A gloo process group of one rank (this process), for the duration of the test."""
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
