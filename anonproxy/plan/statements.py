"""Split a message into statements with sqlglot's tokenizer, and check that PostgreSQL would split it the same way.

A classifier is only as good as its idea of where one statement ends and what
is code rather than string or comment. sqlglot's PostgreSQL tokenizer handles
standard and E'' strings, dollar quotes and nested comments, but it is not
PostgreSQL's lexer, so every token and every gap between tokens is checked
again against PostgreSQL's lexical rules; any disagreement is a refusal
(``U&"..."`` identifiers, a dollar quote glued to an identifier, a ``#``
comment that PostgreSQL would read as an operator, ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

from sqlglot import Token, TokenType, exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.errors import SqlglotError
from sqlglot.parser import Parser
from sqlglot.tokenizer_core import TokenizerCore

from anonproxy.plan.refusals import forbidden, unsupported
from anonproxy.plan.tables import fold

DIALECT = Dialect.get_or_raise("postgres")


class _Core(TokenizerCore):
    """sqlglot's lexer, with a $ read as PostgreSQL reads it: a dollar quote only before a tag and its closing $
    ($$, $tag$). sqlglot takes any text up to the next $ for a tag, so pgjdbc's "in ($1,$2)" (Hibernate) failed
    as a dollar quote tagged "1,"; PostgreSQL reads a parameter there."""

    __slots__ = ()

    def _scan_string(self, start: str) -> bool:
        if start == "$" and not _DOLLAR_TAG.match(self.sql, self._current - 1):
            self._add(TokenType.PARAMETER)
            return True
        return bool(super()._scan_string(start))


class _Tokenizer(DIALECT.tokenizer_class):  # type: ignore[name-defined,misc]
    """PostgreSQL tokens for every statement: no raw-text "command" mode after SHOW, FETCH, EXECUTE, DO, ..."""

    COMMANDS: ClassVar[set[TokenType]] = set()

    def _init_core(self) -> TokenizerCore:
        core: TokenizerCore = super()._init_core()
        core.__class__ = _Core  # the state sqlglot set up, scanned by the lexer above (same slots)
        return core


_TOKENIZER = _Tokenizer(dialect=DIALECT)
_DATE_PART = DIALECT.parser_class.FUNCTION_PARSERS["DATE_PART"]
DATE_PART = "date_part"  # the meta key that marks an exp.Extract written as date_part(...)


def _date_part(parser: Parser) -> exp.Expression:
    """date_part(...) as sqlglot reads it (an exp.Extract), marked so that it is rendered as written
    (anonproxy.plan.render: extract() and date_part() differ in result type)."""
    node: exp.Expression = _DATE_PART(parser)
    if isinstance(node, exp.Extract):
        node.meta[DATE_PART] = True
    return node


def _date_bin(args: list[exp.Expression]) -> exp.Expression:
    """date_bin(stride, source, origin) with the origin kept as written: sqlglot reads a third argument as a unit,
    which turns a quoted origin into a bare word (rendered unquoted: arithmetic). Other arities are no date_bin
    PostgreSQL has: left as an unknown function."""
    if len(args) != 3:
        return exp.Anonymous(this="date_bin", expressions=args)
    stride, source, origin = args
    return exp.DateBin(this=stride, expression=source, origin=origin)


class _Parser(DIALECT.parser_class):  # type: ignore[name-defined,misc]
    FUNCTIONS: ClassVar[dict[str, Callable[..., exp.Expression]]] = {
        **DIALECT.parser_class.FUNCTIONS, "DATE_BIN": _date_bin}
    FUNCTION_PARSERS: ClassVar[dict[str, Callable[[Parser], exp.Expr]]] = {
        **DIALECT.parser_class.FUNCTION_PARSERS, "DATE_PART": _date_part}

    def _parse_types(self, check_func: bool = False, schema: bool = False, allow_identifiers: bool = True,
                     with_collation: bool = False) -> exp.Expr | None:
        """A type as sqlglot reads it, and an object identifier type's ``[]``: sqlglot returns oid, regclass,
        regtype and their kin before their array brackets, so catalog reads such as asyncpg's
        ``any($1::oid[])`` did not parse."""
        parsed: exp.Expr | None = super()._parse_types(check_func, schema, allow_identifiers, with_collation)
        if isinstance(parsed, exp.ObjectIdentifier):
            while self._match_pair(TokenType.L_BRACKET, TokenType.R_BRACKET):
                parsed = exp.DataType(this=exp.DataType.Type.ARRAY, expressions=[parsed], nested=True)
        if isinstance(parsed, exp.DataType):
            parsed = parsed.transform(_float_precision)  # float(p)[] too
        return parsed


def _float_precision(datatype: exp.Expression) -> exp.Expression:
    """float(p) as PostgreSQL's grammar reads it: real for 1 to 24 bits, double precision for 25 to 53 (sqlglot
    reads every float(p) as double precision), so that the column's type, its name (float4) and a parameter's
    type are PostgreSQL's. Another precision is left as written: PostgreSQL refuses it, the planner too."""
    if not isinstance(datatype, exp.DataType):
        return datatype
    params = datatype.expressions
    bits = params[0].this if len(params) == 1 and isinstance(params[0], exp.DataTypeParam) else None
    if (datatype.this != exp.DataType.Type.DOUBLE or not isinstance(bits, exp.Literal) or bits.is_string
            or not (bits.name.isascii() and bits.name.isdigit()) or not 1 <= int(bits.name) <= 53):
        return datatype
    real = int(bits.name) <= 24
    return exp.DataType(this=exp.DataType.Type.FLOAT if real else exp.DataType.Type.DOUBLE)


def parser() -> Parser:
    """A parser for the tokens of :func:`split`: PostgreSQL's dialect, date_part() marked."""
    return _Parser(dialect=DIALECT)

PARSE_HINT = "Send one SQL statement that PostgreSQL's grammar accepts, without unusual quoting."

_WHITESPACE = " \t\n\r\f\v"
_WORD = re.compile(r"[A-Za-z_\x80-\U0010ffff][\w$\x80-\U0010ffff]*")
_IDENT_CHAR = re.compile(r"[\w$\x80-\U0010ffff]")
_DOLLAR_TAG = re.compile(r"\$([A-Za-z_\x80-\U0010ffff][\w\x80-\U0010ffff]*)?\$")

# The full spelling PostgreSQL's lexer gives each kind of quoted token.
_TOKEN_SHAPES: dict[TokenType, re.Pattern[str]] = {
    TokenType.STRING: re.compile(r"'(?:[^']|'')*'", re.DOTALL),
    TokenType.NATIONAL_STRING: re.compile(r"[nN]'(?:[^']|'')*'", re.DOTALL),
    TokenType.BYTE_STRING: re.compile(r"[eE]'(?:[^'\\]|''|\\.)*'", re.DOTALL),  # E'...' escape strings
    TokenType.UNICODE_STRING: re.compile(r"[uU]&'(?:[^']|'')*'", re.DOTALL),
    TokenType.BIT_STRING: re.compile(r"[bB]'[01]*'"),
    TokenType.HEX_STRING: re.compile(r"[xX]'[0-9A-Fa-f]*'|0[xX][0-9A-Fa-f_]+"),
    TokenType.IDENTIFIER: re.compile(r'"(?:[^"]|"")+"', re.DOTALL),
}


@dataclass(frozen=True)
class Statement:
    """One statement of a message: its tokens, which index into ``source`` (the whole message)."""

    source: str
    tokens: tuple[Token, ...]

    @property
    def text(self) -> str:
        return self.source[self.tokens[0].start : self.tokens[-1].end + 1]

    def raw(self, index: int) -> str:
        """The original spelling of token ``index`` (quotes included)."""
        token = self.tokens[index]
        return self.source[token.start : token.end + 1]

    def span(self, first: int, stop: int) -> str:
        """Original text of tokens ``first`` .. ``stop - 1``, comments between them included."""
        if stop <= first:
            raise unsupported("empty clause", PARSE_HINT)
        return self.source[self.tokens[first].start : self.tokens[stop - 1].end + 1]

    def word(self, index: int) -> str | None:
        """The token as an upper-case bare word (keyword or unquoted name), else None."""
        if not 0 <= index < len(self.tokens):
            return None
        raw = self.raw(index)
        return raw.upper() if _WORD.fullmatch(raw) else None

    def words(self, limit: int | None = None) -> list[str | None]:
        count = len(self.tokens) if limit is None else min(limit, len(self.tokens))
        return [self.word(i) for i in range(count)]


def tokenize(sql: str) -> list[Token]:
    try:
        tokens: list[Token] = _TOKENIZER.tokenize(sql)
    except SqlglotError as exc:
        raise unsupported(f"could not read the statement: {_first_line(exc)}", PARSE_HINT) from None
    _check_lexing(sql, tokens)
    return tokens


def split(sql: str) -> list[Statement]:
    """The non-empty statements of ``sql``, in order."""
    statements: list[Statement] = []
    current: list[Token] = []
    for token in column_labels(sql, tokenize(sql)):
        if token.token_type == TokenType.SEMICOLON:
            if current:
                statements.append(Statement(sql, tuple(current)))
            current = []
        else:
            current.append(token)
    if current:
        statements.append(Statement(sql, tuple(current)))
    return statements


# --- column labels ------------------------------------------------------------

# Tokens that end a select list at its own parenthesis depth.
_AFTER_SELECT_LIST = frozenset({
    TokenType.FROM, TokenType.INTO, TokenType.WHERE, TokenType.GROUP_BY, TokenType.HAVING, TokenType.WINDOW,
    TokenType.ORDER_BY, TokenType.LIMIT, TokenType.OFFSET, TokenType.FETCH, TokenType.UNION, TokenType.INTERSECT,
    TokenType.EXCEPT, TokenType.FOR, TokenType.SEMICOLON,
})  # fmt: skip


def column_labels(sql: str, tokens: list[Token]) -> list[Token]:
    """``tokens`` with every word right after AS in a select list read as the column label it is.

    PostgreSQL takes any word, reserved keywords included, as a label after AS (``count(*) AS select``: the
    grammar's ColLabel); sqlglot reads some of them as the keyword and fails, and later checks of the tokens
    would take others (``AS grouping``) for the construct they name. Such a word becomes a quoted identifier of
    its folded spelling (``AS SELECT`` names the column ``select``), which is what PostgreSQL makes of it; token
    positions are kept, so the original text still spans it. Elsewhere (``CAST(x AS int)``, a table alias,
    ``WINDOW w AS (...)``) AS is left alone.
    """
    labelled = list(tokens)
    in_list = [False]  # per parenthesis depth: inside a select list
    for index, token in enumerate(tokens):
        kind = labelled[index].token_type  # a label made below is no longer a keyword
        if kind in _OPEN:
            in_list.append(False)
        elif kind in _CLOSE:
            if len(in_list) > 1:
                in_list.pop()
        elif kind == TokenType.SELECT:
            in_list[-1] = True
        elif kind in _AFTER_SELECT_LIST:
            in_list[-1] = False
        elif kind == TokenType.ALIAS and in_list[-1] and index + 1 < len(tokens):
            label = tokens[index + 1]
            raw = sql[label.start : label.end + 1]
            if label.token_type != TokenType.IDENTIFIER and _WORD.fullmatch(raw):
                labelled[index + 1] = Token(TokenType.IDENTIFIER, fold(raw, False), label.line, label.col,
                                            label.start, label.end, label.comments)
    return labelled


# --- token navigation -------------------------------------------------------

_OPEN = {TokenType.L_PAREN: TokenType.R_PAREN, TokenType.L_BRACKET: TokenType.R_BRACKET}
_CLOSE = {TokenType.R_PAREN, TokenType.R_BRACKET}


def depth_zero(tokens: tuple[Token, ...] | list[Token], first: int = 0, stop: int | None = None) -> Iterator[int]:
    """Indices in [first, stop) of tokens outside any parentheses or brackets (relative to ``first``)."""
    stop = len(tokens) if stop is None else stop
    depth = 0
    for index in range(first, stop):
        kind = tokens[index].token_type
        if kind in _OPEN:
            if depth == 0:
                yield index
            depth += 1
        elif kind in _CLOSE:
            depth -= 1
            if depth < 0:
                raise unsupported("unbalanced parentheses", PARSE_HINT)
            if depth == 0:
                yield index
        elif depth == 0:
            yield index
    if depth != 0:
        raise unsupported("unbalanced parentheses", PARSE_HINT)


def split_commas(tokens: tuple[Token, ...], first: int, stop: int) -> list[tuple[int, int]]:
    """[first, stop) cut at top-level commas, as (first, stop) pairs."""
    parts: list[tuple[int, int]] = []
    start = first
    for index in depth_zero(tokens, first, stop):
        if tokens[index].token_type == TokenType.COMMA:
            parts.append((start, index))
            start = index + 1
    parts.append((start, stop))
    return parts


def closing_paren(tokens: tuple[Token, ...], open_index: int) -> int:
    """Index of the parenthesis that closes the one at ``open_index``."""
    depth = 0
    for index in range(open_index, len(tokens)):
        kind = tokens[index].token_type
        if kind in _OPEN:
            depth += 1
        elif kind in _CLOSE:
            depth -= 1
            if depth == 0:
                return index
    raise unsupported("unbalanced parentheses", PARSE_HINT)


def token_at(tokens: tuple[Token, ...], position: int) -> int:
    """Index of the token that starts at character ``position``."""
    for index, token in enumerate(tokens):
        if token.start == position:
            return index
    raise unsupported("could not locate an expression in the statement text", PARSE_HINT)


# --- lexical cross-check ----------------------------------------------------


def _check_lexing(sql: str, tokens: list[Token]) -> None:
    position = 0
    previous: Token | None = None
    for token in tokens:
        if token.start < position:
            raise unsupported("overlapping tokens", PARSE_HINT)
        _check_gap(sql, position, token.start)
        raw = sql[token.start : token.end + 1]
        _check_token(sql, token, raw, previous)
        if (previous is not None and previous.token_type == TokenType.PARAMETER
                and (token.token_type != TokenType.NUMBER or token.start != previous.end + 1 or not raw.isdigit())):
            raise unsupported("a $ must be followed by a parameter number", "Use $1, $2, ... for parameters.")
        if (previous is not None and previous.token_type == TokenType.NUMBER and token.start == previous.end + 1
                and _IDENT_CHAR.match(sql[token.start])):
            # sqlglot reads 1_000, 0o17 or 1e5e as a number and an alias; PostgreSQL 16 reads the first two as
            # one number (1000, 15), and 15 refuses them all as trailing junk.
            raise unsupported(f"a number glued to a name near {sql[previous.start:token.end + 1][:20]!r} is read "
                              "differently by PostgreSQL versions", "Separate them with a space, or write the number "
                              "in decimal digits.")
        position = token.end + 1
        previous = token
    if previous is not None and previous.token_type == TokenType.PARAMETER:
        raise unsupported("a $ must be followed by a parameter number", "Use $1, $2, ... for parameters.")
    _check_gap(sql, position, len(sql))


def _check_token(sql: str, token: Token, raw: str, previous: Token | None) -> None:
    kind = token.token_type
    shape = _TOKEN_SHAPES.get(kind)
    if shape is not None and not shape.fullmatch(raw):
        raise unsupported(f"ambiguous quoting near {raw[:20]!r}", PARSE_HINT)
    if kind == TokenType.HEREDOC_STRING:
        tag = _DOLLAR_TAG.match(raw)
        if tag is None or len(raw) < 2 * len(tag.group(0)) or not raw.endswith(tag.group(0)):
            raise unsupported("malformed dollar quote", PARSE_HINT)
        if tag.group(0) in raw[len(tag.group(0)) : len(raw) - len(tag.group(0))]:
            raise unsupported("malformed dollar quote", PARSE_HINT)
        if token.start > 0 and _IDENT_CHAR.match(sql[token.start - 1]):
            raise unsupported("a dollar quote right after a name is ambiguous; add a space", PARSE_HINT)
    if (kind == TokenType.IDENTIFIER and previous is not None and previous.token_type == TokenType.AMP
            and token.start == previous.end + 1 and previous.start >= 1 and sql[previous.start - 1] in "uU"):
        raise unsupported('U&"..." identifiers are not supported; write the name plainly', PARSE_HINT)
    if kind == TokenType.PARAMETER and raw != "$":
        raise unsupported(f"unsupported parameter marker {raw!r}", "Use $1, $2, ... for parameters.")
    if kind == TokenType.PLACEHOLDER or (kind == TokenType.UNKNOWN and not _WORD.fullmatch(raw)):  # not the word
        raise unsupported(f"unexpected character {raw!r}", PARSE_HINT)


def _check_gap(sql: str, position: int, stop: int) -> None:
    """Between two tokens PostgreSQL must see only whitespace and comments, exactly as sqlglot did."""
    while position < stop:
        char = sql[position]
        if char in _WHITESPACE:
            position += 1
        elif sql.startswith("--", position):
            ends = [i for i in (sql.find("\n", position), sql.find("\r", position)) if i >= 0]
            position = min(ends) + 1 if ends else len(sql)
            if position > stop:
                raise unsupported("a comment ends where PostgreSQL would not end it", PARSE_HINT)
        elif sql.startswith("/*", position):
            depth, position = 1, position + 2
            while depth:
                if position >= stop:
                    raise unsupported("unterminated or ambiguous comment", PARSE_HINT)
                if sql.startswith("/*", position):
                    depth, position = depth + 1, position + 2
                elif sql.startswith("*/", position):
                    depth, position = depth - 1, position + 2
                else:
                    position += 1
            if position > stop:
                raise unsupported("unterminated or ambiguous comment", PARSE_HINT)
        else:
            raise unsupported(f"unexpected text {sql[position:position + 20]!r}", PARSE_HINT)


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__


# What a query statement may be at its top: one SELECT, set operation, VALUES or parenthesised query.
_QUERY_TOPS = (exp.Select, exp.SetOperation, exp.Values, exp.Subquery)


def parse_statement(statement: Statement) -> exp.Expression:
    """The one sqlglot parse of a query statement (the router's, or the dp planner's for a text of its own)."""
    try:
        trees = parser().parse(list(statement.tokens), statement.source)
    except SqlglotError as exc:
        first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise unsupported(f"could not parse the statement: {first_line}", PARSE_HINT) from None
    trees = [tree for tree in trees if tree is not None]
    if len(trees) != 1:
        raise unsupported("could not parse the statement", PARSE_HINT)
    tree = trees[0]
    if isinstance(tree, (exp.DML, exp.DDL, exp.Command)):
        raise forbidden(f"{type(tree).__name__.upper()} is not allowed for anonymized roles", PARSE_HINT)
    if not isinstance(tree, _QUERY_TOPS):
        raise unsupported(f"could not read {type(tree).__name__.upper()} as a query", PARSE_HINT)
    return tree
