r"""Marker expressions (``-m``) and marker spellings, with pytest's grammar and semantics.

A case selects itself into a run through its markers, exactly as a pytest item does with ``-m``, so
that people who know pytest need to learn nothing new. The expression grammar is pytest's (>= 8.3):

    expression: expr? EOF
    expr:       and_expr ('or' and_expr)*
    and_expr:   not_expr ('and' not_expr)*
    not_expr:   'not' not_expr | '(' expr ')' | ident kwargs?
    ident:      (\w|:|\+|-|\.|\[|\]|\\|/)+
    kwargs:     ('(' name '=' value ( ', ' name '=' value )*  ')')
    name:       a valid Python identifier that is not a reserved keyword
    value:      '...' or "..." (no backslash escapes) | -?[0-9]+ | True | False | None

- An empty expression matches nothing.
- ``ident`` asks the matcher whether the case has that marker; ``ident(k=v, ...)`` asks whether it has
  that marker with those keyword arguments.
- ``or``, ``and`` and ``not`` are the usual short-circuit boolean operators.

pytest compiles an expression to Python bytecode; here it becomes a small tree of frozen dataclasses,
which gives the same results without ``eval`` and without mangling identifiers such as ``None`` or
``if`` that are not valid Python names.

The catalog spells a marker the way it would be applied in code, e.g. ``gpu_1`` or
``requested_vllm_kv_cache_bytes(1119388000)``; :func:`parse_marker_use` reads that spelling with the
same tokens, so that every value it accepts can be written in an expression too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import keyword
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import NoReturn, final

from matrix.errors import ConfigError, MatrixError

__all__ = [
    "Expression",
    "MarkerExpressionError",
    "MarkerUse",
    "UnknownMarkerError",
    "check_known",
    "matches",
    "parse_marker_use",
]

Matcher = Callable[[str, Mapping[str, object]], bool]
# Deeper nesting of `not` and parentheses is refused with a clear error (exit 2): the parser recurses once
# per level, and no CI expression comes near this.
MAX_NESTING = 100

_EMPTY: Mapping[str, object] = MappingProxyType({})


def _shown(text: str) -> str:
    """`text` for an error message: its start when it is long (a 5,000-digit number makes one line unreadable)."""
    return text if len(text) <= 200 else text[:200] + "..."


class MarkerExpressionError(MatrixError):
    """A marker expression does not follow the grammar; `column` is 1-based, as pytest reports it."""

    def __init__(self, message: str, expression: str, column: int) -> None:
        # A 5,000-character expression would make the one line of the error unreadable: show its start.
        super().__init__(f"invalid marker expression {_shown(expression)!r}: at column {column}: {message}")
        self.message = message
        self.expression = expression
        self.column = column


class UnknownMarkerError(MatrixError):
    """A marker expression names markers that are not registered (strict markers)."""

    def __init__(self, message: str, expression: str, unknown: tuple[str, ...]) -> None:
        super().__init__(message)
        self.expression = expression
        self.unknown = unknown


class _ParseError(Exception):
    """Raised inside the parser; the public entry points turn it into the error type their caller expects."""

    def __init__(self, message: str, column: int) -> None:
        super().__init__(message)
        self.message = message
        self.column = column


# ---------------------------------------------------------------------------------------------------
# Tokens


class _Kind(enum.Enum):
    # The values are the words pytest uses in "expected X; got Y", so the messages read the same.
    LPAREN = "left parenthesis"
    RPAREN = "right parenthesis"
    OR = "or"
    AND = "and"
    NOT = "not"
    IDENT = "identifier"
    EOF = "end of input"
    EQUAL = "="
    STRING = "string literal"
    COMMA = ","


@dataclasses.dataclass(frozen=True, slots=True)
class _Token:
    kind: _Kind
    value: str
    pos: int  # 0-based offset into the text


_IDENT_RE = re.compile(r"[\w:+\-.\[\]\\/]+")
_PUNCTUATION = {"(": _Kind.LPAREN, ")": _Kind.RPAREN, "=": _Kind.EQUAL, ",": _Kind.COMMA}
_OPERATORS = {"or": _Kind.OR, "and": _Kind.AND, "not": _Kind.NOT}
_CONSTANTS: dict[str, object] = {"True": True, "False": False, "None": None}


class _Scanner:
    """A one-token-lookahead view of the text.

    Tokens are produced lazily, like pytest's, so that when a text has both a grammar error and a
    bad character further on, the error reported is the one pytest reports: the first one reached.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self._tokens = self._lex()
        self.current = next(self._tokens)

    def _lex(self) -> Iterator[_Token]:
        text, pos = self.text, 0
        while pos < len(text):
            char = text[pos]
            if char in " \t":
                pos += 1
            elif char in _PUNCTUATION:
                yield _Token(_PUNCTUATION[char], char, pos)
                pos += 1
            elif char in "'\"":
                end = text.find(char, pos + 1)
                if end == -1:
                    raise _ParseError(f'closing quote "{char}" is missing', pos + 1)
                # Backslashes are refused rather than interpreted, as pytest does, so nobody is
                # surprised by which escapes exist.
                backslash = text.find("\\", pos, end)
                if backslash != -1:
                    raise _ParseError(r'escaping with "\" not supported in marker expression', backslash + 1)
                yield _Token(_Kind.STRING, text[pos : end + 1], pos)
                pos = end + 1
            elif match := _IDENT_RE.match(text, pos):
                word = match.group()
                yield _Token(_OPERATORS.get(word, _Kind.IDENT), word, pos)
                pos = match.end()
            else:
                # A control character (a CR pasted from a Windows file) is named by its escape: printed as it
                # is, it would break the one-line error in two (or move the cursor back over it).
                shown = char if char.isprintable() else ascii(char)[1:-1]
                raise _ParseError(f'unexpected character "{shown}"', pos + 1)
        yield _Token(_Kind.EOF, "", pos)

    def accept(self, kind: _Kind) -> _Token | None:
        """Consume and return the current token if it is of `kind`."""
        token = self.current
        if token.kind is not kind:
            return None
        if kind is not _Kind.EOF:
            self.current = next(self._tokens)
        return token

    def expect(self, kind: _Kind) -> _Token:
        token = self.accept(kind)
        if token is None:
            self.reject((kind,))
        return token

    def reject(self, expected: Sequence[_Kind]) -> NoReturn:
        wanted = " OR ".join(kind.value for kind in expected)
        raise _ParseError(f"expected {wanted}; got {self.current.kind.value}", self.current.pos + 1)


# ---------------------------------------------------------------------------------------------------
# Expression tree


@dataclasses.dataclass(frozen=True, slots=True)
class _Ident:
    name: str
    kwargs: tuple[tuple[str, object], ...]  # a tuple keeps the node hashable and immutable

    def evaluate(self, matcher: Matcher) -> bool:
        return bool(matcher(self.name, MappingProxyType(dict(self.kwargs)) if self.kwargs else _EMPTY))


@dataclasses.dataclass(frozen=True, slots=True)
class _Not:
    operand: _Node

    def evaluate(self, matcher: Matcher) -> bool:
        return not self.operand.evaluate(matcher)


# A chain `a and b and c ...` is one node with every operand, not a left-nested tree: evaluating a chain of
# thousands of operands must not recurse thousands of levels. all()/any() short-circuit as `and`/`or` do.
@dataclasses.dataclass(frozen=True, slots=True)
class _And:
    operands: tuple[_Node, ...]

    def evaluate(self, matcher: Matcher) -> bool:
        return all(operand.evaluate(matcher) for operand in self.operands)


@dataclasses.dataclass(frozen=True, slots=True)
class _Or:
    operands: tuple[_Node, ...]

    def evaluate(self, matcher: Matcher) -> bool:
        return any(operand.evaluate(matcher) for operand in self.operands)


_Node = _Ident | _Not | _And | _Or


class _Parser:
    """Recursive descent over the grammar in the module docstring; records identifiers as it goes."""

    def __init__(self, text: str) -> None:
        self.s = _Scanner(text)
        self.idents: dict[str, None] = {}  # a dict keeps first-appearance order, for messages
        self.depth = 0

    @contextlib.contextmanager
    def nested(self, token: _Token) -> Iterator[None]:
        """One more level of `not` or parentheses; past MAX_NESTING a clear error, not a RecursionError."""
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise _ParseError(f"nested deeper than {MAX_NESTING} levels of `not` and parentheses", token.pos + 1)
        try:
            yield
        finally:
            self.depth -= 1

    def expression(self) -> _Node | None:
        if self.s.accept(_Kind.EOF):
            return None
        node = self.expr()
        self.s.expect(_Kind.EOF)
        return node

    def expr(self) -> _Node:
        operands = [self.and_expr()]
        while self.s.accept(_Kind.OR):
            operands.append(self.and_expr())
        return operands[0] if len(operands) == 1 else _Or(tuple(operands))

    def and_expr(self) -> _Node:
        operands = [self.not_expr()]
        while self.s.accept(_Kind.AND):
            operands.append(self.not_expr())
        return operands[0] if len(operands) == 1 else _And(tuple(operands))

    def not_expr(self) -> _Node:
        token = self.s.current
        if self.s.accept(_Kind.NOT):
            with self.nested(token):
                return _Not(self.not_expr())
        if self.s.accept(_Kind.LPAREN):
            with self.nested(token):
                node = self.expr()
            self.s.expect(_Kind.RPAREN)
            return node
        ident = self.s.accept(_Kind.IDENT)
        if ident is None:
            self.s.reject((_Kind.NOT, _Kind.LPAREN, _Kind.IDENT))
        self.idents[ident.value] = None
        kwargs: tuple[tuple[str, object], ...] = ()
        if self.s.accept(_Kind.LPAREN):
            kwargs = self.kwargs()
            self.s.expect(_Kind.RPAREN)
        return _Ident(ident.value, kwargs)

    def kwargs(self) -> tuple[tuple[str, object], ...]:
        seen: dict[str, object] = {}
        while True:
            name = _keyword_name(self.s.expect(_Kind.IDENT))
            if name.value in seen:
                # pytest gets this from Python's compiler, at column 1; the name's own column is more use.
                raise _ParseError(f"keyword argument repeated: {name.value}", name.pos + 1)
            self.s.expect(_Kind.EQUAL)
            seen[name.value] = _value(self.s)
            if not self.s.accept(_Kind.COMMA):
                return tuple(seen.items())


def _keyword_name(token: _Token) -> _Token:
    if not token.value.isidentifier():
        raise _ParseError(f"not a valid python identifier {token.value}", token.pos + 1)
    if keyword.iskeyword(token.value):
        raise _ParseError(f"unexpected reserved python keyword `{token.value}`", token.pos + 1)
    return token


def _value(s: _Scanner) -> object:
    string = s.accept(_Kind.STRING)
    if string is not None:
        return string.value[1:-1]
    return _constant(s.expect(_Kind.IDENT))


def _constant(token: _Token) -> object:
    """The value of an unquoted literal: an int (possibly negative), True, False or None."""
    text = token.value
    # isdecimal() is exactly what int() accepts; pytest's isdigit() would also let "²" through to a crash.
    if text.removeprefix("-").isdecimal():
        try:
            return int(text)
        except ValueError:  # over Python's int-string limit (sys.get_int_max_str_digits(), 4300 by default)
            digits = len(text.removeprefix("-"))
            raise _ParseError(
                f"integer {text[:12]}... has {digits} digits, more than the {sys.get_int_max_str_digits()} "
                "Python reads: write a shorter number",
                token.pos + 1,
            ) from None
    if text in _CONSTANTS:
        return _CONSTANTS[text]
    raise _ParseError(f'unexpected character/s "{text}"', token.pos + 1)


@final
@dataclasses.dataclass(frozen=True)
class Expression:
    """A compiled marker expression; compile once, evaluate against many cases."""

    text: str
    _root: _Node | None = dataclasses.field(repr=False, compare=False)
    _idents: tuple[str, ...] = dataclasses.field(repr=False, compare=False)

    @classmethod
    def compile(cls, text: str) -> Expression:
        """Parse `text`; raises MarkerExpressionError if it does not follow the grammar."""
        try:
            parser = _Parser(text)
            root = parser.expression()
        except _ParseError as err:
            raise MarkerExpressionError(err.message, text, err.column) from None
        return cls(text, root, tuple(parser.idents))

    def evaluate(self, matcher: Matcher) -> bool:
        """Whether the expression holds, asking `matcher(name, kwargs)` about each marker it names.

        `kwargs` is empty for a bare name. As with pytest, evaluation short-circuits, so the matcher is
        not asked about names whose answer cannot change the result.
        """
        return self._root is not None and self._root.evaluate(matcher)

    def names(self) -> frozenset[str]:
        """Every marker name the expression mentions (keyword-argument names are not marker names)."""
        return frozenset(self._idents)


# ---------------------------------------------------------------------------------------------------
# Markers as applied to cases


@dataclasses.dataclass(frozen=True)
class MarkerUse:
    """One marker on a case: its name and arguments, e.g. ``profiled_vram_gib(16)``."""

    name: str
    args: tuple[object, ...] = ()
    kwargs: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Frozen means frozen all the way down: copy the arguments so the caller's dict cannot change us.
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", MappingProxyType(dict(self.kwargs)))

    def __hash__(self) -> int:
        # A mapping proxy is not hashable; the set of its items is, and ignores their order as == does.
        return hash((self.name, self.args, frozenset(self.kwargs.items())))

    def __str__(self) -> str:
        """The catalog spelling, which parse_marker_use reads back."""
        if not self.args and not self.kwargs:
            return self.name
        parts = [_format_value(arg) for arg in self.args]
        parts += [f"{key}={_format_value(value)}" for key, value in self.kwargs.items()]
        return f"{self.name}({', '.join(parts)})"


def _format_value(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"' if "'" in value else f"'{value}'"
    return repr(value)


def parse_marker_use(text: str) -> MarkerUse:
    """Read a catalog spelling such as ``gpu_1`` or ``foo(16, key='v', flag=True)``.

    Values are those an expression can match: quoted strings, ints, True, False and None. Positional
    arguments come first, as in a Python call. Raises ConfigError naming `text`.
    """
    try:
        s = _Scanner(text)
        name = s.expect(_Kind.IDENT)
        args: list[object] = []
        kwargs: dict[str, object] = {}
        if s.accept(_Kind.LPAREN) and not s.accept(_Kind.RPAREN):
            while True:
                _argument(s, args, kwargs)
                if not s.accept(_Kind.COMMA):
                    break
            s.expect(_Kind.RPAREN)
        s.expect(_Kind.EOF)
    except _ParseError as err:
        raise ConfigError(f"invalid marker {_shown(text)!r}: at column {err.column}: {err.message}") from None
    return MarkerUse(name.value, tuple(args), kwargs)


def _argument(s: _Scanner, args: list[object], kwargs: dict[str, object]) -> None:
    """Parse one argument of a catalog spelling into `args` or `kwargs`."""
    pos = s.current.pos
    if s.current.kind is _Kind.STRING:
        value = _value(s)
    else:
        token = s.expect(_Kind.IDENT)
        if s.accept(_Kind.EQUAL):
            name = _keyword_name(token).value
            if name in kwargs:
                raise _ParseError(f"keyword argument repeated: {name}", pos + 1)
            kwargs[name] = _value(s)
            return
        value = _constant(token)
    if kwargs:
        raise _ParseError("positional argument follows keyword argument", pos + 1)
    args.append(value)


_MISSING = object()


def matches(expression: Expression, markers: Iterable[MarkerUse]) -> bool:
    """Whether a case carrying `markers` is selected by `expression`, as pytest's MarkMatcher decides.

    A bare name matches any marker of that name, whatever its arguments, so ``profiled_vram_gib``
    selects ``profiled_vram_gib(16)``. ``name(k=v, ...)`` matches if one marker of that name has all
    those keyword arguments equal (by ==, as in pytest); positional arguments are never compared.
    """
    by_name: dict[str, list[Mapping[str, object]]] = {}
    for marker in markers:
        by_name.setdefault(marker.name, []).append(marker.kwargs)

    def matcher(name: str, kwargs: Mapping[str, object]) -> bool:
        return any(
            all(have.get(key, _MISSING) == want for key, want in kwargs.items())
            for have in by_name.get(name, ())
        )

    return expression.evaluate(matcher)


def check_known(expression: Expression, known: Iterable[str]) -> None:
    """Strict markers: raise UnknownMarkerError if the expression names a marker not in `known`.

    A typo would otherwise silently select nothing (or, under ``not``, everything).
    """
    registered = set(known)
    unknown = tuple(name for name in expression._idents if name not in registered)
    if not unknown:
        return
    hints = [
        (name, close[0])
        for name in unknown
        if (close := difflib.get_close_matches(name, sorted(registered), n=1))
    ]
    if len(unknown) == 1:
        message = f"unknown marker {unknown[0]!r}"
    else:
        message = "unknown markers " + ", ".join(repr(name) for name in unknown)
    message += f" in expression {expression.text!r}"
    if len(unknown) == 1 and hints:
        message += f"; did you mean {hints[0][1]!r}?"
    elif hints:
        message += "; did you mean " + ", ".join(f"{hint!r} for {name!r}" for name, hint in hints) + "?"
    message += " (see `matrix markers list`, or pass --no-strict-markers)"
    raise UnknownMarkerError(message, expression.text, unknown)
