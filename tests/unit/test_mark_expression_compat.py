"""pytest's own marker-expression cases, run against matrix.markers.

These follow pytest's testing/test_mark_expression.py case by case, so that an expression means the
same under ``matrix run -m`` as under ``pytest -m``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from matrix.markers import Expression, MarkerExpressionError, MarkerUse, matches


def evaluate(text: str, matcher: Callable[[str, Mapping[str, object]], bool]) -> bool:
    return Expression.compile(text).evaluate(matcher)


def true_false(name: str, kwargs: Mapping[str, object]) -> bool:
    return {"true": True, "false": False}[name]


def test_empty_is_false() -> None:
    for text in ("", "   ", "\t"):
        assert not evaluate(text, lambda name, kwargs: False)
        assert not evaluate(text, lambda name, kwargs: True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("false", False),
        ("not true", False),
        ("not false", True),
        ("not not true", True),
        ("not not false", False),
        ("true and true", True),
        ("true and false", False),
        ("false and true", False),
        ("true and true and true", True),
        ("true and true and false", False),
        ("true and true and not true", False),
        ("false or false", False),
        ("false or true", True),
        ("true or true", True),
        ("true or true or false", True),
        ("true and true or false", True),
        ("not true or true", True),
        ("(not true) or true", True),
        ("not (true or true)", False),
        ("true and true or false and false", True),
        ("true and (true or false) and false", False),
        ("true and (true or (not (not false))) and false", False),
    ],
)
def test_basic(text: str, expected: bool) -> None:
    assert evaluate(text, true_false) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("               true           ", True),
        ("               ((((((true))))))           ", True),
        ("     (         ((\t  (((true)))))  \t   \t)", True),
        ("(     true     and   (((false))))", False),
        ("not not not not true", True),
        ("not not not not not true", False),
    ],
)
def test_syntax_oddities(text: str, expected: bool) -> None:
    assert evaluate(text, true_false) is expected


def test_backslash_not_treated_specially() -> None:
    # Node ids escape special characters into two characters (a backslash and a letter), so
    # expressions never need escapes: a backslash is an ordinary identifier character.
    def matcher(name: str, kwargs: Mapping[str, object]) -> bool:
        return name == r"\nfoo\n"

    assert evaluate(r"\nfoo\n", matcher)
    assert not evaluate("foo", matcher)
    with pytest.raises(MarkerExpressionError):
        evaluate("\nfoo\n", matcher)


@pytest.mark.parametrize(
    ("text", "column", "message"),
    [
        ("(", 2, "expected not OR left parenthesis OR identifier; got end of input"),
        (" (", 3, "expected not OR left parenthesis OR identifier; got end of input"),
        (")", 1, "expected not OR left parenthesis OR identifier; got right parenthesis"),
        (") ", 1, "expected not OR left parenthesis OR identifier; got right parenthesis"),
        ("not", 4, "expected not OR left parenthesis OR identifier; got end of input"),
        ("not not", 8, "expected not OR left parenthesis OR identifier; got end of input"),
        ("(not)", 5, "expected not OR left parenthesis OR identifier; got right parenthesis"),
        ("and", 1, "expected not OR left parenthesis OR identifier; got and"),
        ("ident and", 10, "expected not OR left parenthesis OR identifier; got end of input"),
        ("ident and or", 11, "expected not OR left parenthesis OR identifier; got or"),
        ("ident ident", 7, "expected end of input; got identifier"),
    ],
)
def test_syntax_errors(text: str, column: int, message: str) -> None:
    with pytest.raises(MarkerExpressionError) as excinfo:
        evaluate(text, lambda name, kwargs: True)
    assert excinfo.value.column == column
    assert excinfo.value.message == message
    assert excinfo.value.expression == text
    assert str(excinfo.value) == f"invalid marker expression {text!r}: at column {column}: {message}"


@pytest.mark.parametrize(
    "ident",
    [
        ".",
        "...",
        ":::",
        "a:::c",
        "a+-b",
        r"\nhe\\l\lo\n\t\rbye",
        "a/b",
        "/:\\/",
        "אבגד",
        "aaאבגדcc",
        "a[bcd]",
        "1234",
        "1234abcd",
        "1234and",
        "1234or",
        "1234not",
        "notandor",
        "not_and_or",
        "not[and]or",
        "1234+5678",
        "123.232",
        "True",
        "False",
        "None",
        "if",
        "else",
        "while",
    ],
)
def test_valid_idents(ident: str) -> None:
    assert evaluate(ident, lambda name, kwargs: name == ident)
    assert Expression.compile(ident).names() == {ident}


@pytest.mark.parametrize(
    "ident",
    ["^", "*", "=", "&", "%", "$", "#", "@", "!", "~", "{", "}", '"', "'", "|", ";", "←"],
)
def test_invalid_idents(ident: str) -> None:
    with pytest.raises(MarkerExpressionError):
        evaluate(ident, lambda name, kwargs: True)


@pytest.mark.parametrize(
    ("text", "column", "message"),
    [
        ("mark()", 6, "expected identifier; got right parenthesis"),
        ("mark(True=False)", 6, "unexpected reserved python keyword `True`"),
        ("mark(def=False)", 6, "unexpected reserved python keyword `def`"),
        ("mark(class=False)", 6, "unexpected reserved python keyword `class`"),
        ("mark(if=False)", 6, "unexpected reserved python keyword `if`"),
        ("mark(else=False)", 6, "unexpected reserved python keyword `else`"),
        ("mark(valid=False, def=1)", 19, "unexpected reserved python keyword `def`"),
        ("mark(1)", 6, "not a valid python identifier 1"),
        ("mark(var:=False", 6, "not a valid python identifier var:"),
        ("mark(1=2)", 6, "not a valid python identifier 1"),
        ("mark(/=2)", 6, "not a valid python identifier /"),
        ("mark(var==", 10, "expected identifier; got ="),
        ("mark(var)", 9, "expected =; got right parenthesis"),
        ("mark(var=none)", 10, 'unexpected character/s "none"'),
        ("mark(var=1.1)", 10, 'unexpected character/s "1.1"'),
        ("mark(var=')", 10, """closing quote "'" is missing"""),
        ('mark(var=")', 10, 'closing quote """ is missing'),
        ("""mark(var="')""", 10, 'closing quote """ is missing'),
        ("""mark(var='")""", 10, """closing quote "'" is missing"""),
        (r"mark(var='\hugo')", 11, r'escaping with "\" not supported in marker expression'),
        ("mark(empty_list=[])", 17, 'unexpected character/s "[]"'),
        ("'str'", 1, "expected not OR left parenthesis OR identifier; got string literal"),
        # Beyond pytest's list: the same rules, at the edges.
        ("mark(a=1,)", 10, "expected identifier; got right parenthesis"),
        ("mark(a=1 b=2)", 10, "expected right parenthesis; got identifier"),
        ("mark(a=True", 12, "expected right parenthesis; got end of input"),
        ("mark(a=--1)", 8, 'unexpected character/s "--1"'),
        ("mark(a=+1)", 8, 'unexpected character/s "+1"'),
        ("mark(a=-)", 8, 'unexpected character/s "-"'),
        ("mark(a=²)", 8, 'unexpected character/s "²"'),
        ("mark(a=1)(b=2)", 10, "expected end of input; got left parenthesis"),
        ("mark(a=1, a=2)", 11, "keyword argument repeated: a"),
        # pytest's message holds the raw newline; matrix writes it as its escape so the error stays on one line.
        ("a\nb", 2, 'unexpected character "\\n"'),
        # The grammar error comes first, so the bad character after it is never reached.
        ("a b $", 3, "expected end of input; got identifier"),
    ],
)
def test_invalid_kwarg_name_or_value(text: str, column: int, message: str) -> None:
    with pytest.raises(MarkerExpressionError) as excinfo:
        Expression.compile(text)
    assert (excinfo.value.message, excinfo.value.column) == (message, column)


MARKERS = [
    MarkerUse("number_mark", kwargs={"a": 1, "b": 2, "c": 3, "d": 999_999}),
    MarkerUse("builtin_matchers_mark", kwargs={"x": True, "y": False, "z": None}),
    MarkerUse(
        "str_mark",
        kwargs={"m": "M", "space": "with space", "empty": "", "aaאבגדcc": "aaאבגדcc", "אבגד": "אבגד"},
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("number_mark(a=1)", True),
        ("number_mark(b=2)", True),
        ("number_mark(a=1,b=2)", True),
        ("number_mark(a=1,     b=2)", True),
        ("number_mark(d=999999)", True),
        ("number_mark(a   =   1,b= 2,     c = 3)", True),
        ("number_mark(a=6)", False),
        ("number_mark(b=6)", False),
        ("number_mark(a=1,b=6)", False),
        ("number_mark(a=6,b=2)", False),
        ("number_mark(a   =   1,b= 2,     c = 6)", False),
        ("number_mark(a='1')", False),
        ("number_mark(e=1)", False),
        ("number_mark(a=-1)", False),
    ],
)
def test_keyword_expressions_with_numbers(text: str, expected: bool) -> None:
    assert matches(Expression.compile(text), MARKERS) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("builtin_matchers_mark(x=True)", True),
        ("builtin_matchers_mark(x=False)", False),
        ("builtin_matchers_mark(y=True)", False),
        ("builtin_matchers_mark(y=False)", True),
        ("builtin_matchers_mark(z=None)", True),
        ("builtin_matchers_mark(z=False)", False),
        ("builtin_matchers_mark(z=True)", False),
        ("builtin_matchers_mark(z=0)", False),
        ("builtin_matchers_mark(z=1)", False),
        # A missing keyword is not None.
        ("builtin_matchers_mark(w=None)", False),
    ],
)
def test_builtin_matchers_keyword_expressions(text: str, expected: bool) -> None:
    assert matches(Expression.compile(text), MARKERS) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("str_mark(m='M')", True),
        ('str_mark(m="M")', True),
        ("str_mark(aaאבגדcc='aaאבגדcc')", True),
        ("str_mark(אבגד='אבגד')", True),
        ("str_mark(space='with space')", True),
        ("str_mark(empty='')", True),
        ('str_mark(empty="")', True),
        ("str_mark(m='wrong')", False),
        ("str_mark(aaאבגדcc='wrong')", False),
        ("str_mark(אבגד='wrong')", False),
        ("str_mark(m='')", False),
        ('str_mark(m="")', False),
        # Quotes of the other kind are ordinary characters inside a string.
        ("""str_mark(m="'M'")""", False),
    ],
)
def test_str_keyword_expressions(text: str, expected: bool) -> None:
    assert matches(Expression.compile(text), MARKERS) is expected


def test_kwargs_reach_the_matcher() -> None:
    seen: list[tuple[str, dict[str, object]]] = []

    def matcher(name: str, kwargs: Mapping[str, object]) -> bool:
        seen.append((name, dict(kwargs)))
        return True

    assert evaluate("""a and b(x=1, y='s', z=None, t=True, n=-2, q="d q")""", matcher)
    assert seen == [("a", {}), ("b", {"x": 1, "y": "s", "z": None, "t": True, "n": -2, "q": "d q"})]


def test_evaluation_short_circuits() -> None:
    seen: list[str] = []

    def matcher(name: str, kwargs: Mapping[str, object]) -> bool:
        seen.append(name)
        return name == "yes"

    assert evaluate("yes or boom", matcher)
    assert not evaluate("no and boom", matcher)
    assert seen == ["yes", "no"]
