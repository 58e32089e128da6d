"""Which order a plan's layout follows (deft.runtime.layouts.plan_order): a given profile's, where it
names exactly the model's parameters, pieces of a cut one included; else the observed ready order."""

from __future__ import annotations

from deft.profile import Bucket, BucketTimes, Link, Profile
from deft.runtime.layouts import plan_order

NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]  # registration order
OBSERVED = [3, 2, 1, 0]  # the ready order a run saw


def profile(*buckets: tuple[str, ...]) -> Profile:
    times = tuple(BucketTimes(0.001, 0.001, {"l": 0.001}) for _ in buckets)
    return Profile(tuple(Bucket(b, names, 10, 40) for b, names in enumerate(buckets)), times,
                   (Link("l", "gloo"),), 2, "synthetic")


def test_a_given_profile_whose_pieces_name_the_parameters_sets_the_order() -> None:
    # a measured profile: a parameter cut into consecutive pieces, named by their ranges
    given = profile(("0.bias",), ("2.weight[0:32]",), ("2.weight[32:64]",), ("module.2.bias", "0.weight"))
    assert plan_order(given, True, NAMES, OBSERVED) == [1, 2, 3, 0]


def test_a_profile_naming_a_parameter_twice_apart_or_other_parameters_leaves_the_observed_order() -> None:
    apart = profile(("2.weight[0:32]",), ("0.bias",), ("2.weight[32:64]",), ("2.bias", "0.weight"))
    other = profile(("0.bias",), ("2.weight",), ("2.bias",), ("3.weight",))
    assert plan_order(apart, True, NAMES, OBSERVED) == OBSERVED
    assert plan_order(other, True, NAMES, OBSERVED) == OBSERVED


def test_a_measured_profile_leaves_the_observed_order() -> None:
    measured = profile(("0.bias",), ("2.weight",), ("2.bias",), ("0.weight",))
    assert plan_order(measured, False, NAMES, OBSERVED) == OBSERVED
