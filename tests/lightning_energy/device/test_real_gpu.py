"""The NVML backend on this machine's real NVIDIA GPUs, read-only: nothing is changed.

Skipped unless the NVML library loads and sees at least one GPU (``-m gpu`` selects
these tests, ``-m "not gpu"`` leaves them out).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_energy.device import GPU
from lightning_energy.device.base import LeaseSource
from lightning_energy.device.nvml import NVMLGPU, nvml_gpus
from lightning_energy.errors import NotSupportedError

ROOT = Path(__file__).resolve().parents[3]
CHECK_NVML = ROOT / "benchmarks" / "gpu" / "check_nvml.py"

pytestmark = pytest.mark.gpu


def _real_gpu_count() -> int:
    """GPUs the NVML library of this machine sees; 0 without the library, driver or GPU."""
    try:
        pynvml = importlib.import_module("pynvml")
        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, no libnvidia-ml.so, no driver: all mean "no GPU"
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture(scope="module")
def gpu_count() -> int:
    count = _real_gpu_count()
    if count == 0:
        pytest.skip("needs a real NVIDIA GPU with NVML")
    return count


@pytest.fixture
def gpus(gpu_count: int) -> Iterator[list[NVMLGPU]]:
    opened = nvml_gpus()
    yield opened
    for gpu in opened:
        gpu.close()


def test_check_nvml_reads_every_gpu_and_changes_nothing(gpu_count: int) -> None:
    out = subprocess.run(
        [sys.executable, str(CHECK_NVML), "--read-only", "--json"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    reports = json.loads(out.stdout)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        assert len(reports) == gpu_count
    for report in reports:
        assert report["skipped"] == "--read-only"
        assert report["problems"] == []
        low_w, high_w = report["values"]["power_limit_constraints_w"]
        assert 0 < low_w <= high_w


def test_the_backend_reads_real_gpus_in_si_units(gpus: list[NVMLGPU]) -> None:
    assert gpus
    for gpu in gpus:
        assert isinstance(gpu, GPU)
        assert gpu.lease_source() == LeaseSource("nvml")
        before = (gpu.power_limit_w(), gpu.locked_clocks_mhz())
        try:
            low_w, high_w = gpu.power_limit_constraints_w()
        except NotSupportedError:
            continue  # no power management on this board: nothing more to read
        assert 0 < low_w <= gpu.default_power_limit_w() <= high_w
        assert low_w <= gpu.power_limit_w() <= high_w
        assert 0 < gpu.enforced_power_limit_w() <= high_w
        assert gpu.power_w() >= 0
        first_s, first_j = gpu.now_s(), gpu.energy_j()
        gpu.idle(3 * gpu.energy_counter_period_s())
        assert gpu.now_s() > first_s
        assert gpu.energy_j() >= first_j  # a cumulative counter never goes back
        assert (gpu.power_limit_w(), gpu.locked_clocks_mhz()) == before
