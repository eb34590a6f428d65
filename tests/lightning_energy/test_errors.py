"""How errors list their problems: every configuration problem, and the first twenty of a
malformed file's."""

from __future__ import annotations

import pytest

from lightning_energy.errors import ConfigError, ProfileError, raise_profile_problems


def test_a_config_error_names_one_problem_or_lists_them_all() -> None:
    assert str(ConfigError("a: bad")) == "invalid configuration: a: bad"
    error = ConfigError([f"key{i}: bad" for i in range(25)], source="energy.yaml")
    lines = str(error).splitlines()
    assert lines[0] == "25 problems in the configuration in energy.yaml:"
    assert lines[1:] == [f"  - key{i}: bad" for i in range(25)]


def test_a_profile_error_lists_the_first_twenty_problems_and_counts_the_rest() -> None:
    raise_profile_problems([], "a clean file")  # nothing to report
    with pytest.raises(ProfileError) as info:
        raise_profile_problems([f"row {i}: bad" for i in range(25)], "the profile run.csv")
    lines = str(info.value).splitlines()
    assert lines[0] == "25 problem(s) in the profile run.csv:"
    assert lines[1:21] == [f"  - row {i}: bad" for i in range(20)]
    assert lines[21:] == ["  - ... and 5 more"]
