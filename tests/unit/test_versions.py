"""PEP 440 parsing, ordering, tags, --since/--until windows, catalog constraints and fixes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from matrix.errors import ConfigError
from matrix.versions import (
    VersionBound,
    VersionWindow,
    component_has_fix,
    parse_bound,
    parse_specifier,
    parse_version,
    specifier_admits,
    tag_for,
)

# Release, pre-release, dev and local builds as runtimes ship them, in ascending PEP 440 order.
CHAIN = ["0.29.0", "0.29.1rc0", "0.29.1rc1.dev347+gdee37d891", "0.29.1rc1", "0.30.0"]
VLLM_54814 = ["0.29.1rc0", "0.30.0"]


def V(text: str) -> Version:
    return parse_version(text)


def test_domain_chain_is_strictly_ascending() -> None:
    versions = [V(text) for text in CHAIN]
    assert all(a < b for a, b in itertools.pairwise(versions))
    assert sorted(reversed(versions)) == versions


@pytest.mark.parametrize("text", ["0.30.0", "v0.30.0", "V0.30.0", " v0.30.0 "])
def test_parse_version_accepts_tag_spellings(text: str) -> None:
    assert parse_version(text) == Version("0.30.0")


@pytest.mark.parametrize("text", ["x.y", "", "latest", "0.30.0-foo-bar", "vv0.30.0", "0.30.0 rc"])
def test_parse_version_rejects_invalid(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_version(text)
    assert str(info.value) == (f"invalid version {text!r}: not a PEP 440 version (e.g. 0.30.0, v0.29.1rc0)")


def test_invalid_version_message_matches_contract() -> None:
    with pytest.raises(ConfigError, match=r"^invalid version 'x\.y': not a PEP 440 version \(e\.g\. 0\.30\.0"):
        parse_version("x.y")


@pytest.mark.parametrize(
    ("text", "tag"),
    [
        ("0.30.0", "v0.30.0"),
        ("v0.29.1rc0", "v0.29.1rc0"),
        ("0.29.1rc1.dev347+gdee37d891", "v0.29.1rc1.dev347+gdee37d891"),
        ("1.3.0-rc27", "v1.3.0rc27"),  # normalised
    ],
)
def test_tag_for(text: str, tag: str) -> None:
    assert tag_for(V(text)) == tag
    assert parse_version(tag) == V(text)


def test_parse_bound_global_and_scoped() -> None:
    assert parse_bound("v0.29.0") == VersionBound(None, Version("0.29.0"))
    assert parse_bound("vllm=0.29.0") == VersionBound("vllm", Version("0.29.0"))
    assert parse_bound("VLLM=v0.29.0") == VersionBound("vllm", Version("0.29.0"))
    assert parse_bound("vllm-rs=0.29.1rc0") == VersionBound("vllm-rs", Version("0.29.1rc0"))
    assert str(parse_bound("sglang=0.5.18")) == "sglang=0.5.18"
    assert str(parse_bound("v0.5.18")) == "0.5.18"


@pytest.mark.parametrize("text", ["=0.29.0", "vllm>=0.29.0", "vllm==0.29.0", "vllm=", "vl lm=0.29.0"])
def test_parse_bound_rejects_invalid(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_bound(text)


def window(since: Sequence[str] = (), until: Sequence[str] = ()) -> VersionWindow:
    return VersionWindow(tuple(map(parse_bound, since)), tuple(map(parse_bound, until)))


def test_empty_window_admits_everything() -> None:
    assert VersionWindow().admits("vllm", V("0.0.1")) == (True, None)


def test_window_bounds_are_inclusive() -> None:
    w = window(["0.29.0"], ["0.30.0"])
    assert w.admits("vllm", V("0.29.0")) == (True, None)
    assert w.admits("vllm", V("0.30.0")) == (True, None)
    assert w.admits("vllm", V("0.28.0")) == (False, "0.28.0 is before --since 0.29.0")
    assert w.admits("vllm", V("0.30.1")) == (False, "0.30.1 is after --until 0.30.0")


def test_window_includes_prereleases_in_pep440_order() -> None:
    w = window(["0.29.1rc0"], ["0.29.1rc1"])
    admitted = [text for text in CHAIN if w.admits("vllm", V(text))[0]]
    assert admitted == ["0.29.1rc0", "0.29.1rc1.dev347+gdee37d891", "0.29.1rc1"]


def test_scoped_bound_applies_only_to_its_backend_and_wins_over_global() -> None:
    w = window(["0.29.0", "sglang=0.5.18"], ["trtllm=1.3.0rc27"])
    # vllm: global since only.
    assert w.admits("vllm", V("0.28.9")) == (False, "0.28.9 is before --since 0.29.0")
    assert w.admits("vllm", V("9.0")) == (True, None)
    # sglang: scoped since replaces the global one (0.5.18 < 0.29.0 would otherwise fail).
    assert w.admits("sglang", V("0.5.18")) == (True, None)
    assert w.admits("sglang", V("0.5.17")) == (False, "0.5.17 is before --since sglang=0.5.18")
    # trtllm: global since, scoped until; directions resolve independently.
    assert w.admits("trtllm", V("1.3.0rc27")) == (True, None)
    assert w.admits("trtllm", V("1.3.0")) == (False, "1.3.0 is after --until trtllm=1.3.0rc27")
    assert w.admits("trtllm", V("0.20.0")) == (False, "0.20.0 is before --since 0.29.0")
    assert w.admits("TRTLLM", V("1.3.0")) == (False, "1.3.0 is after --until trtllm=1.3.0rc27")


def test_repeated_bounds_all_hold() -> None:
    w = window(["vllm=0.29.0", "vllm=0.29.1rc0"])
    assert w.admits("vllm", V("0.29.0")) == (False, "0.29.0 is before --since vllm=0.29.1rc0")
    assert w.admits("vllm", V("0.29.1rc1.dev347+gdee37d891")) == (True, None)


def test_window_that_admits_nothing_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"--since 0.30.0 is after --until 0.29.0"):
        window(["0.30.0"], ["0.29.0"])
    with pytest.raises(ConfigError, match=r"backend 'vllm'"):
        window(["vllm=0.30.0"], ["0.29.0"])
    # A scoped bound that rescues the backend keeps the window valid.
    window(["0.30.0", "sglang=0.5.0"], ["0.40.0", "sglang=0.6.0"])
    # ... while a global since past a scoped until empties that backend.
    with pytest.raises(ConfigError, match=r"backend 'sglang'"):
        window(["0.30.0"], ["sglang=0.6.0"])


def test_parse_specifier_and_prereleases_always_admitted() -> None:
    spec = parse_specifier(">=0.29.0")
    assert specifier_admits(spec, V("0.29.1rc1.dev347+gdee37d891"))
    assert specifier_admits(spec, V("0.29.1rc0"))
    assert not specifier_admits(spec, V("0.28.0"))
    trt = parse_specifier(" >=1.3.0rc27 ")
    assert specifier_admits(trt, V("1.3.0rc27"))
    assert not specifier_admits(trt, V("1.3.0rc26"))
    assert specifier_admits(parse_specifier(""), V("0.1.0.dev1"))
    # Even a set that was built to refuse pre-releases admits them through the helper.
    assert specifier_admits(SpecifierSet(">=0.29.0", prereleases=False), V("0.29.1rc0"))


@pytest.mark.parametrize("text", ["0.29.0", "=>0.29", ">=x.y", "~=1", ">=0.29;<1"])
def test_parse_specifier_rejects_invalid(text: str) -> None:
    with pytest.raises(ConfigError, match=r"not a PEP 440 specifier"):
        parse_specifier(text)


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.28.5", False),
        ("0.29.0", False),
        ("0.29.1rc0", True),
        ("0.29.1rc1.dev347+gdee37d891", True),
        ("0.29.1", True),
        ("0.30.0rc1", False),
        ("0.30.0", True),
        ("0.31.0", True),
        ("1.0.0", True),
    ],
)
def test_component_has_fix_vllm_54814(version: str, expected: bool) -> None:
    assert component_has_fix(V(version), VLLM_54814) is expected
    # Order and tag spelling of the list do not matter.
    assert component_has_fix(V(version), ["v0.30.0", "v0.29.1rc0"]) is expected


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.28.8", False),
        ("0.28.9", True),
        ("0.28.10", True),
        ("0.29.0", False),  # cut before the backport reached 0.28.9's newer sibling line
        ("0.29.1rc0", True),
        ("0.29.5", True),
        ("0.30.0", True),
    ],
)
def test_component_has_fix_backport(version: str, expected: bool) -> None:
    assert component_has_fix(V(version), ["0.28.9", "0.29.1rc0"]) is expected


def test_component_has_fix_skipped_line() -> None:
    # Backported to 0.28 but never to 0.29: every 0.29 lacks it, 0.30 onward has it.
    fixed_in = ["0.28.9", "0.30.0"]
    assert not component_has_fix(V("0.29.7"), fixed_in)
    assert component_has_fix(V("0.28.9"), fixed_in)
    assert component_has_fix(V("0.31.2"), fixed_in)


def test_component_has_fix_edge_inputs() -> None:
    assert not component_has_fix(V("9.9.9"), [])
    with pytest.raises(ConfigError, match=r"release line 0.29"):
        component_has_fix(V("0.29.3"), ["0.29.1", "0.29.2"])
    with pytest.raises(ConfigError, match=r"invalid version 'soon'"):
        component_has_fix(V("0.29.3"), ["soon"])
