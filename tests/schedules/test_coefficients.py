"""Newton–Schulz coefficient schedules by name (`canzona.schedules.coefficients`): how many
iterations each covers and what happens past its end."""

from __future__ import annotations

import pytest

from canzona.schedules.coefficients import DEFAULT_NS_COEFFICIENTS, NS_COEFFICIENT_SCHEDULES, coefficient_steps


def test_each_iteration_takes_its_own_triple() -> None:
    quintic = NS_COEFFICIENT_SCHEDULES["quintic"]
    assert len(quintic) == 5 and len(set(quintic)) == 5
    assert coefficient_steps("quintic", 5) == quintic
    assert coefficient_steps("quintic", 3) == quintic[:3]


def test_quintic_starts_again_and_polar_express_repeats_its_last() -> None:
    quintic, polar = NS_COEFFICIENT_SCHEDULES["quintic"], NS_COEFFICIENT_SCHEDULES["polar_express"]
    assert coefficient_steps("quintic", 7) == quintic + quintic[:2]
    assert coefficient_steps("polar_express", 10) == polar + (polar[-1],) * 2
    assert coefficient_steps(DEFAULT_NS_COEFFICIENTS, 4) == ((3.4445, -4.7750, 2.0315),) * 4


def test_every_schedule_maps_zero_to_zero_and_grows_small_singular_values() -> None:
    """p(σ) = aσ + bσ³ + cσ⁵ is odd with slope a > 1 at zero: small singular values grow."""
    for name, table in NS_COEFFICIENT_SCHEDULES.items():
        assert all(a > 1 for a, _, _ in table), name


def test_an_unknown_name_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        coefficient_steps("cubic", 5)
