"""matrix.markers beyond pytest: catalog spellings, strict-marker checks and the CI selections."""

from __future__ import annotations

import pytest

from matrix.errors import ConfigError, MatrixError
from matrix.markers import (
    Expression,
    MarkerExpressionError,
    MarkerUse,
    UnknownMarkerError,
    check_known,
    matches,
    parse_marker_use,
)

KNOWN = [
    "pre_merge",
    "post_merge",
    "nightly",
    "sidecar",
    "vllm",
    "sglang",
    "gpu_1",
    "gpu_2",
    "h100",
    "profiled_vram_gib",
    "requested_vllm_kv_cache_bytes",
]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpu_1", MarkerUse("gpu_1")),
        ("  gpu_1 ", MarkerUse("gpu_1")),
        ("gpu_1()", MarkerUse("gpu_1")),
        (
            "requested_vllm_kv_cache_bytes(1119388000)",
            MarkerUse("requested_vllm_kv_cache_bytes", (1119388000,)),
        ),
        ("profiled_vram_gib(16)", MarkerUse("profiled_vram_gib", (16,))),
        ("foo(key='v', n=3)", MarkerUse("foo", kwargs={"key": "v", "n": 3})),
        ('foo("v", -3, True, False, None)', MarkerUse("foo", ("v", -3, True, False, None))),
        ("foo(1, 'two', three=3)", MarkerUse("foo", (1, "two"), {"three": 3})),
        ("foo(a=1,b=2)", MarkerUse("foo", kwargs={"b": 2, "a": 1})),
    ],
)
def test_parse_marker_use(text: str, expected: MarkerUse) -> None:
    assert parse_marker_use(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "at column 1: expected identifier; got end of input"),
        ("and", "at column 1: expected identifier; got and"),
        ("gpu_1 gpu_2", "at column 7: expected end of input; got identifier"),
        ("foo(", "at column 5: expected identifier; got end of input"),
        ("foo(1,)", "at column 7: expected identifier; got right parenthesis"),
        ("foo(1.5)", 'at column 5: unexpected character/s "1.5"'),
        ("foo(bar)", 'at column 5: unexpected character/s "bar"'),
        ("foo(a=1, 2)", "at column 10: positional argument follows keyword argument"),
        ("foo(a=1, a=2)", "at column 10: keyword argument repeated: a"),
        ("foo(if=1)", "at column 5: unexpected reserved python keyword `if`"),
        ("foo('x)", """at column 5: closing quote "'" is missing"""),
        ("foo@", 'at column 4: unexpected character "@"'),
        ("@", 'at column 1: unexpected character "@"'),
    ],
)
def test_parse_marker_use_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_marker_use(text)
    assert str(excinfo.value) == f"invalid marker {text!r}: {message}"


@pytest.mark.parametrize(
    "text",
    ["gpu_1", "profiled_vram_gib(16)", "foo(key='v', n=3)", 'foo(1, "it\'s", x=None, y=False)'],
)
def test_str_round_trips(text: str) -> None:
    marker = parse_marker_use(text)
    assert str(marker) == text
    assert parse_marker_use(str(marker)) == marker


def test_marker_use_is_frozen_and_hashable() -> None:
    kwargs: dict[str, object] = {"n": 3}
    marker = MarkerUse("foo", kwargs=kwargs)
    kwargs["n"] = 4  # the caller's dict is copied, not shared
    assert marker.kwargs == {"n": 3}
    with pytest.raises(TypeError):
        marker.kwargs["n"] = 5  # type: ignore[index]
    assert len({marker, MarkerUse("foo", (), {"n": 3}), parse_marker_use("foo(n=3)")}) == 1
    assert MarkerUse("foo").kwargs == {}


def test_names() -> None:
    expression = Expression.compile("(pre_merge or post_merge) and vllm(x=1) and not h100 and vllm")
    assert expression.names() == {"pre_merge", "post_merge", "vllm", "h100"}
    assert Expression.compile("").names() == frozenset()
    assert Expression.compile("a(b=1)").names() == {"a"}  # keyword names are not markers


def test_expression_value() -> None:
    expression = Expression.compile("a and b")
    assert expression.text == "a and b"
    assert expression == Expression.compile("a and b")
    assert repr(expression) == "Expression(text='a and b')"


def test_error_message_names_expression_and_column() -> None:
    with pytest.raises(MarkerExpressionError) as excinfo:
        Expression.compile("pre_merge and")
    assert isinstance(excinfo.value, MatrixError)
    assert str(excinfo.value) == (
        "invalid marker expression 'pre_merge and': at column 14: "
        "expected not OR left parenthesis OR identifier; got end of input"
    )


def test_check_known_accepts_registered() -> None:
    check_known(Expression.compile("(pre_merge or post_merge) and vllm and gpu_1"), KNOWN)
    check_known(Expression.compile(""), [])


def test_check_known_suggests_close_match() -> None:
    with pytest.raises(UnknownMarkerError) as excinfo:
        check_known(Expression.compile("pre_merg and gpu_1"), KNOWN)
    assert isinstance(excinfo.value, MatrixError)
    assert excinfo.value.unknown == ("pre_merg",)
    assert str(excinfo.value) == (
        "unknown marker 'pre_merg' in expression 'pre_merg and gpu_1'; did you mean 'pre_merge'? "
        "(see `matrix markers list`, or pass --no-strict-markers)"
    )


def test_check_known_lists_every_unknown() -> None:
    with pytest.raises(UnknownMarkerError) as excinfo:
        check_known(Expression.compile("nightlly and zzz and not gpu1"), KNOWN)
    assert excinfo.value.unknown == ("nightlly", "zzz", "gpu1")
    assert str(excinfo.value) == (
        "unknown markers 'nightlly', 'zzz', 'gpu1' in expression 'nightlly and zzz and not gpu1'; "
        "did you mean 'nightly' for 'nightlly', 'gpu_1' for 'gpu1'? "
        "(see `matrix markers list`, or pass --no-strict-markers)"
    )


def test_check_known_without_suggestion() -> None:
    with pytest.raises(UnknownMarkerError, match=r"^unknown marker 'zzz' in expression 'zzz' \(see"):
        check_known(Expression.compile("zzz"), KNOWN)


def markers(*spellings: str) -> list[MarkerUse]:
    return [parse_marker_use(spelling) for spelling in spellings]


VLLM_SIDECAR = markers("pre_merge", "sidecar", "vllm", "gpu_1", "requested_vllm_kv_cache_bytes(1119388000)")
VLLM_NIGHTLY = markers("nightly", "vllm", "gpu_1")
VLLM_PROFILED = markers("nightly", "vllm", "gpu_1", "profiled_vram_gib(16)")
SGLANG_POST = markers("post_merge", "sglang", "gpu_1")
SGLANG_H100 = markers("post_merge", "sglang", "gpu_1", "h100")
VLLM_TWO_GPUS = markers("post_merge", "vllm", "gpu_2")

CASES = {
    "vllm_sidecar": VLLM_SIDECAR,
    "vllm_nightly": VLLM_NIGHTLY,
    "vllm_profiled": VLLM_PROFILED,
    "sglang_post": SGLANG_POST,
    "sglang_h100": SGLANG_H100,
    "vllm_two_gpus": VLLM_TWO_GPUS,
}


@pytest.mark.parametrize(
    ("text", "selected"),
    [
        ("pre_merge and sidecar and gpu_1", {"vllm_sidecar"}),
        ("(pre_merge or post_merge) and vllm and gpu_1", {"vllm_sidecar"}),
        ("sglang and gpu_1 and not h100", {"sglang_post"}),
        ("nightly and vllm and gpu_1 and not profiled_vram_gib", {"vllm_nightly"}),
        ("profiled_vram_gib", {"vllm_profiled"}),
        ("requested_vllm_kv_cache_bytes", {"vllm_sidecar"}),
        ("vllm and not gpu_1", {"vllm_two_gpus"}),
        ("", set()),
    ],
)
def test_ci_selections(text: str, selected: set[str]) -> None:
    expression = Expression.compile(text)
    check_known(expression, KNOWN)
    assert {name for name, case in CASES.items() if matches(expression, case)} == selected


def test_kwargs_never_match_positional_args() -> None:
    # As in pytest: profiled_vram_gib(16) carries 16 positionally, so no keyword can select it.
    expression = Expression.compile("profiled_vram_gib(gib=16)")
    assert not matches(expression, markers("profiled_vram_gib(16)"))
    assert matches(expression, markers("profiled_vram_gib(gib=16)"))


def test_kwargs_match_any_one_marker_with_all_of_them() -> None:
    case = markers("foo(a=1, b=2)", "foo(a=3)")
    assert matches(Expression.compile("foo(a=1, b=2)"), case)
    assert matches(Expression.compile("foo(a=3)"), case)
    assert not matches(Expression.compile("foo(a=3, b=2)"), case)  # no single marker has both
    assert not matches(Expression.compile("bar"), case)


def test_matches_accepts_any_iterable() -> None:
    assert matches(Expression.compile("a and b"), iter(markers("a", "b")))


# --- limits: deep nesting is a clear error, long chains evaluate without recursion ----------------------


def test_nesting_deeper_than_the_limit_is_a_clear_error_with_its_column() -> None:
    from matrix.markers import MAX_NESTING, Expression, MarkerExpressionError

    ok = "(" * MAX_NESTING + "a" + ")" * MAX_NESTING
    assert Expression.compile(ok).evaluate(lambda name, kwargs: name == "a")
    for text in ("(" * 500 + "a" + ")" * 500, "not " * 1000 + "a", "not (" * 60 + "a" + ")" * 60):
        with pytest.raises(MarkerExpressionError, match=f"nested deeper than {MAX_NESTING} levels") as info:
            Expression.compile(text)
        assert info.value.column > MAX_NESTING


def test_long_chains_evaluate_and_short_circuit() -> None:
    from matrix.markers import Expression

    asked: list[str] = []

    def matcher(name: str, kwargs: object) -> bool:
        asked.append(name)
        return name != "stop"

    chain = " and ".join(["a"] * 5000)
    assert Expression.compile(chain).evaluate(matcher)
    asked.clear()
    assert not Expression.compile("a and stop and b and c").evaluate(matcher)
    assert asked == ["a", "stop"]  # `and` stops at the first false operand, as pytest's does
    asked.clear()
    assert Expression.compile("stop or a or b").evaluate(matcher)
    assert asked == ["stop", "a"]
    assert Expression.compile(" or ".join(["stop"] * 5000 + ["a"])).evaluate(matcher)
