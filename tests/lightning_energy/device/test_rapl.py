"""Reading RAPL counters from a powercap tree: what is counted, what is left out, and the
trees and files a real kernel shows (AMD layouts, root-only counters, garbage)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_energy.config import NodeEnergyConfig
from lightning_energy.device.rapl import RaplCounters
from lightning_energy.errors import NodeEnergyError
from lightning_energy.node_energy import NotMeasured, open_counters
from tests.lightning_energy.device.fake_powercap import AMD_RANGE_UJ, FakePowercap


def _open(tree: FakePowercap) -> RaplCounters:
    return RaplCounters(tree.root, read_text=tree.read_text)


def test_packages_and_their_dram_are_counted_and_nothing_twice(tmp_path: Path) -> None:
    tree = FakePowercap.intel(tmp_path, packages=2, psys=True)
    counters = _open(tree)
    labels = [d.label for d in counters.domains]
    assert labels == ["package-0", "package-0/dram", "package-1", "package-1/dram"]
    left_out = "\n".join(counters.left_out)
    for inside in ("package-0/core", "package-0/uncore", "package-1/core", "package-1/uncore"):
        assert f"{inside}: inside" in left_out
    assert "psys" in left_out and "intel-rapl-mmio:0" in left_out
    tree.set_uj("package-1/dram", 1234)
    assert counters.read_uj()[3] == 1234


def test_the_control_type_folder_is_a_root_too(tmp_path: Path) -> None:
    tree = FakePowercap.intel(tmp_path, packages=1)
    counters = RaplCounters(tree.root / "intel-rapl")
    assert [d.label for d in counters.domains] == ["package-0", "package-0/dram"]


def test_amd_packages_have_no_dram_and_their_own_range(tmp_path: Path) -> None:
    counters = _open(FakePowercap.amd(tmp_path, packages=2))
    assert [d.label for d in counters.domains] == ["package-0", "package-1"]
    assert {d.max_energy_range_uj for d in counters.domains} == {AMD_RANGE_UJ}
    assert any("package-0/core: inside" in line for line in counters.left_out)


def test_a_zone_named_like_a_package_already_counted_is_counted_once(tmp_path: Path) -> None:
    tree = FakePowercap(
        tmp_path, [("intel-rapl:0", "package-0", None), ("intel-rapl:1", "package-0", None)]
    )
    counters = _open(tree)
    assert [d.zone for d in counters.domains] == ["intel-rapl:0"]
    assert any("counted once" in line for line in counters.left_out)


def test_a_root_only_counter_is_not_measured_with_the_reason(tmp_path: Path) -> None:
    tree = FakePowercap.intel(tmp_path, packages=2)
    tree.deny("package-1")
    with pytest.raises(NodeEnergyError) as caught:
        _open(tree)
    assert caught.value.why == "RAPL not readable (permission)"
    message = str(caught.value)
    assert str(tree.path("package-1")) in message and "docs/permissions.md" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files of mode 000")
def test_a_counter_of_mode_000_is_not_readable(tmp_path: Path) -> None:
    tree = FakePowercap.intel(tmp_path, packages=1)
    tree.path("package-0").chmod(0)
    found = open_counters(NodeEnergyConfig(powercap_root=str(tree.root)), simulated=True)
    assert isinstance(found, NotMeasured) and found.why == "RAPL not readable (permission)"


def test_an_unreadable_dram_is_left_out_and_the_packages_counted(tmp_path: Path) -> None:
    tree = FakePowercap.intel(tmp_path, packages=2)
    tree.deny("package-0/dram")
    counters = _open(tree)
    assert [d.label for d in counters.domains] == ["package-0", "package-1", "package-1/dram"]
    assert any(
        "package-0/intel-rapl:0:2: not counted" in line and "permission denied" in line
        for line in counters.left_out
    )


def test_no_tree_or_no_package_is_not_measured(tmp_path: Path) -> None:
    missing = open_counters(NodeEnergyConfig(powercap_root=str(tmp_path / "none")), simulated=False)
    assert isinstance(missing, NotMeasured) and missing.why == "no RAPL counters"
    assert str(tmp_path / "none") in missing.reason
    tree = FakePowercap(tmp_path / "psys-only", [("intel-rapl:0", "psys", None)])
    only_psys = open_counters(NodeEnergyConfig(powercap_root=str(tree.root)), simulated=False)
    assert isinstance(only_psys, NotMeasured) and "no RAPL package zone" in only_psys.reason


def test_turned_off_or_simulated_reads_nothing(tmp_path: Path) -> None:
    tree = FakePowercap.intel(tmp_path, packages=1)
    off = open_counters(
        NodeEnergyConfig(enabled=False, powercap_root=str(tree.root)), simulated=False
    )
    assert isinstance(off, NotMeasured) and "node_energy: false" in off.why
    simulated = open_counters(NodeEnergyConfig(), simulated=True)
    assert isinstance(simulated, NotMeasured) and simulated.why == "simulated GPUs"
    given_root = open_counters(NodeEnergyConfig(powercap_root=str(tree.root)), simulated=True)
    assert isinstance(given_root, RaplCounters)


def test_ranks_reading_one_tree_share_a_key_and_other_trees_do_not(tmp_path: Path) -> None:
    a = FakePowercap.intel(tmp_path / "a", packages=1)
    b = FakePowercap.intel(tmp_path / "b", packages=1)
    assert RaplCounters(a.root).key == RaplCounters(a.root / ".." / "powercap").key
    assert RaplCounters(a.root).key != RaplCounters(b.root).key


# ---------------------------------------------------------------------------- bad contents
_BAD_TEXT = st.one_of(
    st.just(""),
    st.just("\n"),
    st.integers(max_value=-1).map(str),
    st.integers(min_value=2**64).map(str),
    st.text(alphabet="abcxyz -+.eE,", min_size=1, max_size=12),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.binary(min_size=1, max_size=8).map(lambda b: b.decode("latin-1")),
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=_BAD_TEXT,
    where=st.sampled_from(
        [("package-0", "energy_uj"), ("package-1", "max_energy_range_uj"), ("package-0", "name")]
    ),
)
def test_a_package_file_holding_garbage_is_not_measured_and_named(
    tmp_path_factory: pytest.TempPathFactory, text: str, where: tuple[str, str]
) -> None:
    tree = FakePowercap.intel(tmp_path_factory.mktemp("tree"), packages=2)
    tree.write(*where, text)
    found = open_counters(NodeEnergyConfig(powercap_root=str(tree.root)), simulated=False)
    if where[1] == "name" and isinstance(found, RaplCounters):
        # A zone not named as a package is left out (and said so), never counted.
        assert [d.label for d in found.domains] == ["package-1", "package-1/dram"]
        assert any(line.startswith("intel-rapl:0 ") for line in found.left_out)
        return
    assert isinstance(found, NotMeasured), f"{text!r} in {where} was read as a counter"
    assert str(tree.path(*where)) in found.reason


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_BAD_TEXT)
def test_a_counter_that_turns_to_garbage_mid_run_raises_only_our_error(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    tree = FakePowercap.intel(tmp_path_factory.mktemp("tree"), packages=1)
    counters = _open(tree)
    tree.write("package-0/dram", "energy_uj", text)
    with pytest.raises(NodeEnergyError, match="energy_uj"):
        counters.read_uj()


def test_a_counter_above_its_range_is_refused(tmp_path: Path) -> None:
    tree = FakePowercap.amd(tmp_path, packages=1)
    counters = _open(tree)
    tree.set_uj("package-0", AMD_RANGE_UJ + 1)
    with pytest.raises(NodeEnergyError, match="above the counter's range"):
        counters.read_uj()
