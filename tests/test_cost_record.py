"""The cost record's table of terms: every field adds to a term of TERMS, the totals
follow the table, and a subclass's own fields join them."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import pytest

from autopar.solvers.cost_record import TERMS, StrategyCost, Totals, term


def test_the_totals_are_the_terms_in_order() -> None:
    assert Totals._fields == tuple(TERMS)


def test_every_field_adds_to_a_term() -> None:
    priced = [f for f in fields(StrategyCost) if f.name not in ("name", "total")]
    assert priced and all(f.metadata.get("adds_to") in TERMS for f in priced)


def test_totals_sum_the_fields_of_each_term_and_follow_replace() -> None:
    s = StrategyCost("s", compute_s=1.0, param_copy_s=0.25, bwd_compute_s=0.5,
                     param_copy_bwd_s=0.125, host_s=2.0, param_host_s=1.0, comm_s=3.0)
    assert (s.total.device_s, s.total.device_bwd_s, s.total.all_host_s, s.total.comm_s) == \
        (1.25, 0.625, 3.0, 3.0)
    assert s.total.optimizer_s == 0.0
    assert replace(s, compute_s=2.0).total.device_s == 2.25


def test_a_subclass_field_joins_its_term() -> None:
    @dataclass
    class Extra(StrategyCost):
        launch_s: float = term("device_s")
        idle_s: float = term("comm_s")

    e = Extra("e", compute_s=1.0, launch_s=0.5, comm_s=1.0, idle_s=2.0)
    assert (e.total.device_s, e.total.comm_s) == (1.5, 3.0)
    assert StrategyCost("s", compute_s=1.0).total.device_s == 1.0  # the base unchanged


def test_an_unknown_term_is_refused() -> None:
    with pytest.raises(ValueError, match="no term 'device'; the terms: device_s, "):
        term("device")
