"""Bad daemon answers (property-based): malformed JSON, missing keys, wrong types, huge
numbers, any status. Each is a clear error naming the endpoint; no value is made up,
nothing on the GPU changes, and nothing is lost (the job observes, its readings go on,
no lease stays behind)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_energy.device import NVMLGPU, open_devices
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.zeusd_client import ZeusdAddress, ZeusdClient
from lightning_energy.errors import DeviceError, DriverError
from tests.lightning_energy.device.fake_pynvml import ERROR_CODES, a100
from tests.lightning_energy.device.fake_zeusd import Answer, Node, zeusd_node

_U32 = 1 << 32
_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 80), max_value=1 << 80),
    st.sampled_from([_U32, 1 << 64, 10**30, -1, 10**400, -(10**400)]),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _encoded(value: Any) -> bytes:
    return json.dumps(value).encode()


def bodies(field: str) -> st.SearchStrategy[bytes]:
    """Answers to a per-GPU read of GPU 0 around the shape ``{"0": {field: ...}}``."""
    return st.one_of(
        st.binary(max_size=48),
        st.sampled_from([b"", b"{", b'{"0": {"%s": 1', b"NaN", b"\xff\xfe{}"]),
        json_values.map(_encoded),
        json_values.map(lambda v: _encoded({"0": v})),
        json_values.map(lambda v: _encoded({"0": {field: v}})),
        json_values.map(lambda v: _encoded({"1": {field: v}})),
    )


def statuses() -> st.SearchStrategy[int]:
    return st.one_of(st.just(200), st.integers(min_value=201, max_value=599))


def _parsed(body: bytes) -> Any:
    """``body`` as JSON, or None when it is not (the oracle of what is well formed)."""
    try:
        return json.loads(body.decode("utf-8"), parse_constant=lambda _: None)
    except ValueError:
        return None


def _int_at(data: Any, path: tuple[str, ...], below: int) -> int | None:
    """The integer in ``0..below-1`` at ``path`` in ``data``, else None."""
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data if type(data) is int and 0 <= data < below else None


def _well_formed_read(path: str, data: Any) -> bool:
    if path == "/gpu/get_power_limit_constraints":
        lo = _int_at(data, ("0", "min_power_limit_mw"), _U32)
        hi = _int_at(data, ("0", "max_power_limit_mw"), _U32)
        return lo is not None and hi is not None and lo <= hi
    field = "power_limit_mw" if path == "/gpu/get_power_limit" else "energy_mj"
    return _int_at(data, ("0", field), _U32 if field == "power_limit_mw" else 1 << 64) is not None


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Node]:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0)]) as n:
        yield n


@pytest.fixture
def client(node: Node) -> ZeusdClient:
    return ZeusdClient(ZeusdAddress.parse(node.daemon.address), token=node.token)


READS: dict[str, tuple[str, Callable[[ZeusdClient], object]]] = {
    "/gpu/get_power_limit": ("power_limit_mw", lambda c: c.power_limit_mw(0)),
    "/gpu/get_cumulative_energy": ("energy_mj", lambda c: c.energy_mj(0)),
    "/gpu/get_power_limit_constraints": (
        "max_power_limit_mw",
        lambda c: c.power_limit_constraints_mw(0),
    ),
}


@pytest.mark.parametrize("path", sorted(READS))
def test_a_bad_read_answer_is_a_clear_error_not_a_value(
    node: Node, client: ZeusdClient, path: str
) -> None:
    field, read = READS[path]

    @_SETTINGS
    @given(status=statuses(), body=bodies(field))
    def check(status: int, body: bytes) -> None:
        assume(status != 200 or not _well_formed_read(path, _parsed(body)))
        node.daemon.answers[path] = Answer(status, body)
        with pytest.raises(DeviceError) as info:
            read(client)
        text = str(info.value)
        assert path in text and f"zeusd at {node.daemon.address}" in text
        if status == 200:
            assert type(info.value) is DriverError and "malformed" in text

    check()


def test_a_bad_power_answer_is_a_clear_error(node: Node, client: ZeusdClient) -> None:
    @_SETTINGS
    @given(
        body=st.one_of(
            st.binary(max_size=48),
            json_values.map(_encoded),
            json_values.map(lambda v: _encoded({"timestamp_ms": 1, "power_mw": v})),
            json_values.map(lambda v: _encoded({"timestamp_ms": v, "power_mw": {"0": 1}})),
            json_values.map(lambda v: _encoded({"timestamp_ms": 1, "power_mw": {"0": v}})),
        )
    )
    def check(body: bytes) -> None:
        data = _parsed(body)
        time_ok = _int_at(data, ("timestamp_ms",), 1 << 64) is not None
        assume(not (time_ok and _int_at(data, ("power_mw", "0"), _U32) is not None))
        node.daemon.answers["/gpu/get_power"] = Answer(200, body)
        with pytest.raises(DriverError, match="/gpu/get_power with a malformed body"):
            client.power_mw(0)

    check()


def _discover_bodies() -> st.SearchStrategy[bytes]:
    """``/discover`` answers that cannot be used: not JSON, another shape, or a GPU entry
    with a bad field."""
    good_gpu = {"id": 0, "name": "NVIDIA A100-SXM4-40GB", "pci_address": "0000:10:00.0"}
    base = {"enabled_api_groups": ["gpu-control"], "auth_required": True}

    def usable(key: str, value: Any) -> bool:
        if key == "id":
            return type(value) is int and 0 <= value < 1 << 16
        if key == "pci_address" and value is None:
            return True  # zeusd 0.5.0 reports no PCI address
        return isinstance(value, str) and value.isprintable() and 0 < len(value) <= 256

    def gpu_with(key: str) -> st.SearchStrategy[bytes]:
        bad = json_values.filter(lambda v: not usable(key, v))
        return bad.map(lambda v: _encoded({**base, "gpus": [{**good_gpu, key: v}]}))

    return st.one_of(
        st.binary(max_size=48),
        json_values.filter(lambda v: not isinstance(v, dict)).map(_encoded),
        st.dictionaries(st.sampled_from(["gpus", "gpu_ids", "auth_required"]), json_values).map(
            _encoded
        ),
        gpu_with("id"),
        gpu_with("name"),
        gpu_with("pci_address"),
        json_values.filter(lambda v: not isinstance(v, bool)).map(
            lambda v: _encoded({**base, "auth_required": v, "gpus": [good_gpu]})
        ),
        st.just(_encoded({**base, "gpus": [good_gpu, good_gpu]})),  # an id twice
        st.just(_encoded({**base, "gpu_ids": [0, True]})),
    )


def test_a_bad_discover_answer_changes_nothing_and_loses_nothing(
    node: Node, tmp_path: Path
) -> None:
    devices = open_devices("zeusd")
    gpus: list[NVMLGPU] = list(devices.gpus)  # type: ignore[arg-type]
    lease_dir = tmp_path / "leases"

    @_SETTINGS
    @given(status=statuses(), body=_discover_bodies())
    def check(status: int, body: bytes) -> None:
        if b'"pci_address": "0000:10:00.0"' in body and b'"id": 0,' in body:
            assume(body.count(b'"id": 0,') > 1)  # only the duplicate passes this filter
        node.daemon.answers["/discover"] = Answer(status, body)
        with GPUGuard(gpus, lease_dir=lease_dir, install_signal_handlers=False) as guard:
            assert guard.set_power_limit_w(200.0) == 400.0
            reason = guard.observe_only_reason or ""
            assert "/discover" in reason and f"zeusd at {node.daemon.address}" in reason
            assert gpus[0].energy_j() == 123.456  # readings go on, through NVML
        assert node.nvml.calls == [] and node.nvml.devices[0].limit_mw == 400_000
        assert not list(lease_dir.glob("*.json"))

    try:
        check()
    finally:
        devices.close()


def test_a_bad_answer_where_nvml_fails_raises_nvmls_error(node: Node) -> None:
    """The daemon's reading stands in for NVML's only when it is well formed."""
    node.nvml.devices[0].errors["nvmlDeviceGetPowerManagementLimit"] = ERROR_CODES[
        "NVML_ERROR_UNKNOWN"
    ]
    with open_devices("zeusd") as devices:
        gpu = devices.gpus[0]
        # The daemon shares the failing driver: its answer is an error too.
        with pytest.raises(DriverError, match="NVML: NVML_ERROR_UNKNOWN"):
            gpu.power_limit_w()
        node.daemon.answers["/gpu/get_power_limit"] = Answer(200, b'{"0": {"power_limit_mw": -5}}')
        with pytest.raises(DriverError, match="NVML: NVML_ERROR_UNKNOWN"):
            gpu.power_limit_w()
        node.daemon.answers["/gpu/get_power_limit"] = Answer(
            200, b'{"0": {"power_limit_mw": 5000}}'
        )
        assert gpu.power_limit_w() == 5.0
