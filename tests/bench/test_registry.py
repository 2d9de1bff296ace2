"""The sections' registry and their one interface: every section has a name, `run`, `render`
and `targets`, its typed result round-trips through bench.json, and an empty result (a section
that did not run) renders and yields targets that are never a silent PASS."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from bench.result import Result, Skipped
from bench.sections import NAMES, SECTIONS, parse_names
from bench.sections.base import FAIL, SKIP, Section
from tests.bench.helpers import passing_results


def test_the_registry_lists_each_section_once_in_run_order():
    assert NAMES == ("trunk", "service", "fanout", "grpc", "scale", "coldstart", "baselines",
                     "overload", "fairness", "deadlines", "cancellation", "isolation", "soak", "replicas",
                     "store")
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("section", SECTIONS, ids=NAMES)
def test_every_section_has_the_interface(section):
    assert isinstance(section, Section) and section.name in NAMES
    assert dataclasses.is_dataclass(section.result_type)
    assert issubclass(section.result_type, Result)
    assert list(inspect.signature(section.run).parameters) == ["context"]
    for method in (section.render, section.targets):
        assert len(inspect.signature(method).parameters) == 2
    # Its module names it after itself, so that `--sections` and bench.json agree.
    assert section.run.__module__ == f"bench.sections.{section.name}"


@pytest.mark.parametrize("section", SECTIONS, ids=NAMES)
def test_an_empty_result_renders_and_its_targets_fail_when_selected(section):
    empty = section.result_type()
    assert isinstance(section.render(empty, {}), str)
    for target in section.targets(empty, {}):
        assert target.measured is None or target.limit is None or target.status == SKIP
        assert target.evaluate(set(NAMES)).status in (FAIL, SKIP)
        assert target.evaluate(set()).status == SKIP


@pytest.mark.parametrize("name", [n for n in NAMES if n in passing_results()])
def test_a_result_round_trips_through_its_json(name):
    section = dict(zip(NAMES, SECTIONS))[name]
    data = passing_results()[name]
    result = section.load(data)
    assert isinstance(result, section.result_type)
    again = result.to_json()
    assert {k: v for k, v in again.items() if k in data} == {
        k: v for k, v in data.items() if k in again}
    assert section.result_type.from_json(again) == result


def test_a_skipped_section_loads_as_skipped_and_says_why():
    grpc = dict(zip(NAMES, SECTIONS))["grpc"]
    result = grpc.load({"skipped": "not installed: grpc (the grpc extra)"})
    assert result == Skipped("not installed: grpc (the grpc extra)")
    assert "Skipped: not installed: grpc" in grpc.render(result, {})


def test_section_names_parse_in_the_given_order_without_repeats():
    assert parse_names(" scale,trunk,scale ") == ("scale", "trunk")
    with pytest.raises(ValueError, match=r"^unknown section\(s\) gpu, tpu; choose from trunk,"):
        parse_names("trunk,gpu,tpu")
    with pytest.raises(ValueError, match=r"unknown section\(s\) \(none\)"):
        parse_names(" , ")
