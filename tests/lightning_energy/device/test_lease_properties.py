"""Whole classes of bad lease files: whatever bytes or JSON a user leaves in the lease
directory, ``recover`` answers with a result (never a traceback), and a lease it does not
trust never moves a GPU below where it is, above its default, or into a clock lock."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_energy.device.lease import Lease, LeaseStore
from lightning_energy.device.recovery import recover
from lightning_energy.device.simulated import SimulatedGPU, SimulatedSpec
from tests.lightning_energy.device.test_lease_security import (
    lease_dict,
    plant,
    trusted_uids,
)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX ownership and modes")

UUID = "GPU-sim-a100-0"
STATUSES = {"restored", "would_restore", "skipped", "refused", "failed"}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([10**400, -(10**400)])  # JSON integers past a float's range
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
FIELDS = [k for k in lease_dict(UUID) if k != "owner"]
OWNER_FIELDS = list(lease_dict(UUID)["owner"])


@st.composite
def mutated_leases(draw: st.DrawFn) -> dict[str, Any]:
    """A valid lease with some fields replaced by arbitrary JSON, or removed."""
    data = lease_dict(UUID, gpu_name="NVIDIA A100-SXM4-40GB (simulated)")
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        owner_field = draw(st.booleans())
        target = data["owner"] if owner_field else data
        key = draw(st.sampled_from(OWNER_FIELDS if owner_field else FIELDS))
        if draw(st.integers(min_value=0, max_value=5)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(json_values)
    return data


def run_recover(content: bytes | dict[str, Any], *, untrusted: bool) -> tuple[Any, SimulatedGPU]:
    """Plant ``content`` as the lease of a simulated A100 and run recover over it."""
    gpu = SimulatedGPU(SimulatedSpec(gpu="a100").model(), uuid=UUID)
    with tempfile.TemporaryDirectory() as tmp:
        lease_dir = Path(tmp) / "leases"
        lease_dir.mkdir()
        lease_dir.chmod(0o1777)
        path = lease_dir / f"{UUID}.json"
        plant(path, content, uid=4242 if untrusted else None)
        results = recover(
            lease_dir,
            open_gpu=lambda uuid: gpu,
            trusted_uids=trusted_uids() if untrusted else None,
        )
    (result,) = results
    assert result.status in STATUSES
    assert result.message and result.message.isprintable()
    return result, gpu


def assert_untouched_or_raised_to_default(gpu: SimulatedGPU) -> None:
    default_w = gpu.default_power_limit_w()
    assert gpu.power_limit_w() == default_w  # it started there: nothing lower, nothing higher
    assert gpu.locked_clocks_mhz() is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=st.binary(max_size=300))
def test_any_bytes_give_a_result_and_change_nothing(content: bytes) -> None:
    for untrusted in (True, False):
        result, gpu = run_recover(content, untrusted=untrusted)
        assert result.status in ("refused", "failed")
        assert gpu.settings() == gpu.initial_settings


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=mutated_leases())
def test_another_users_lease_never_lowers_or_locks(data: dict[str, Any]) -> None:
    result, gpu = run_recover(data, untrusted=True)
    assert_untouched_or_raised_to_default(gpu)
    if result.status == "restored":
        Lease.from_dict(data)  # only a well-formed lease is ever acted on


@pytest.mark.gpu_state_may_change
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=mutated_leases())
def test_a_trusted_lease_stays_within_the_driver_limits(data: dict[str, Any]) -> None:
    result, gpu = run_recover(data, untrusted=False)
    lo_w, hi_w = gpu.power_limit_constraints_w()
    assert gpu.initial_settings[0] <= gpu.power_limit_w() <= hi_w and lo_w <= gpu.power_limit_w()
    locked = gpu.locked_clocks_mhz()
    if locked is not None:
        supported = gpu.supported_sm_clocks_mhz()
        assert min(supported) <= locked[0] <= locked[1] <= max(supported)
    if result.status == "failed":
        assert "malformed lease" in result.message or "cannot" in result.message


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "larger than"),
        (b"[" * 30_000 + b"]" * 30_000, "nested too deeply"),
        (b'{"format": 1, "gpu_uuid": "\xff\xfe"}', "not UTF-8"),
        (b'{"format": 1, "power_limit_w": NaN}', "NaN is not a number"),
        (json.dumps(lease_dict(UUID, power_limit_w=True)).encode(), "power_limit_w"),
        (json.dumps(lease_dict(UUID, power_limit_changed="no")).encode(), "power_limit_changed"),
        (json.dumps(lease_dict(UUID, gpu_uuid="GPU\n\x1b[2J")).encode(), "gpu_uuid"),
        (json.dumps(lease_dict(UUID, locked_clocks_mhz=[1410, 210])).encode(), "min_mhz"),
        (json.dumps(lease_dict(UUID, state_path="relative/x")).encode(), "absolute"),
        (json.dumps([lease_dict(UUID)]).encode(), "JSON object"),
    ],
)
def test_each_bad_lease_is_named(content: bytes, why: str) -> None:
    for untrusted in (True, False):
        result, gpu = run_recover(content, untrusted=untrusted)
        assert why in result.message
        assert result.status == ("refused" if untrusted or why == "larger than" else "failed")
        assert gpu.settings() == gpu.initial_settings


HUGE = 10**400  # JSON allows integers past a float's range; ``json`` reads them exactly


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("power_limit_w",), HUGE),
        (("power_limit_w",), -HUGE),
        (("gpu_index",), HUGE),
        (("format",), HUGE),
        (("owner", "pid"), HUGE),
        (("owner", "start_time"), HUGE),
        (("locked_clocks_mhz",), [HUGE, HUGE]),
    ],
    ids=["watts", "negative-watts", "index", "format", "pid", "start-time", "clocks"],
)
def test_integers_past_a_floats_range_are_refused_like_any_bad_number(
    path: tuple[str, ...], value: object
) -> None:
    data = lease_dict(UUID)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    for untrusted in (True, False):
        result, gpu = run_recover(data, untrusted=untrusted)
        assert result.status == ("refused" if untrusted else "failed"), result.message
        assert "malformed lease" in result.message and path[-1] in result.message
        assert gpu.settings() == gpu.initial_settings


def test_a_well_formed_lease_round_trips(tmp_path: Path) -> None:
    lease = Lease.from_dict(lease_dict(UUID))
    store = LeaseStore(tmp_path / "leases")
    store.write(lease)
    read = store.read(UUID)
    assert read == lease
    assert read is not None and read.file_uid == os.geteuid()
