"""Statements other than queries: the session and transaction commands an anonymized role may send.

Recognised by their leading keywords on the token stream (sqlglot models many
of them only as ``exp.Command``), against an allowlist:

* SET / RESET / SHOW of ordinary settings, except ``role`` and
  ``session_authorization`` (who the session is), ``client_encoding`` other
  than UTF8 and ``standard_conforming_strings`` off (both change how the proxy
  must read the SQL text), and ``anonproxy.*`` (set by the policy). ``SET
  search_path`` is allowed: the classifier treats an unqualified name as
  protected if a protected table of that name exists in any schema, and
  rewritten SQL names every table with its schema.
* ``SHOW anonproxy.<name>`` is intercepted: the proxy answers from the policy.
* ``SET anonproxy.epsilon`` / ``anonproxy.delta`` (and RESET) in mode ``dp``:
  the session's own per-query cost, which the proxy accepts only up to the
  policy's (:class:`SessionSetting`).
* ``EXPLAIN (ANONPROXY) <query>``: recognised by :func:`explained_query`,
  answered by the proxy for a dp query without running it (:class:`ExplainDP`).
* BEGIN / START TRANSACTION / COMMIT / END / ROLLBACK / ABORT / SAVEPOINT /
  RELEASE, SET TRANSACTION, SET SESSION CHARACTERISTICS (not two-phase commit).
* DISCARD, DEALLOCATE, LISTEN, UNLISTEN.
* Cursors: ``DECLARE`` is read by :func:`declare_cursor` (its query is decided by the classifier like a plain
  one); FETCH, MOVE and CLOSE by :func:`cursor_command`, normalised as PostgreSQL's grammar does.

Anything else is refused with the statement's kind in the message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import cast

from sqlglot import TokenType

from anonproxy.plan.refusals import (
    INVALID_CURSOR_DEFINITION,
    INVALID_PARAMETER_VALUE,
    SYNTAX_ERROR,
    Refusal,
    forbidden,
    unsupported,
)
from anonproxy.plan.statements import PARSE_HINT, Statement, split
from anonproxy.plan.tables import fold
from anonproxy.route.decision import (
    CloseCursor,
    Control,
    Deallocate,
    Decision,
    FetchCursor,
    Intercept,
    Pass,
    SessionSetting,
    TransactionControl,
)

ALLOWED_HINT = (
    "This role may send: SELECT with aggregates (count, sum, avg) over protected tables, queries that do not "
    "touch protected tables (catalog browsing included), SET/RESET/SHOW of ordinary settings, transaction "
    "control (BEGIN, COMMIT, ROLLBACK, SAVEPOINT), cursors over such queries (DECLARE, FETCH, MOVE, CLOSE), "
    "DISCARD, DEALLOCATE, LISTEN/UNLISTEN."
)

QUERY_STARTS = frozenset({"SELECT", "WITH", "VALUES", "TABLE"})

_SETTING_NAME = re.compile(r"[a-z_][a-z0-9_$]*")
_IDENTITY_SETTINGS = frozenset({"role", "session_authorization"})
_UTF8 = frozenset({"utf8", "utf-8", "unicode", "default"})
_ON = frozenset({"on", "true", "yes", "1", "default"})
_TRANSACTION_WORDS = frozenset({"WORK", "TRANSACTION", "ISOLATION", "LEVEL", "SERIALIZABLE", "REPEATABLE", "READ",
                                "COMMITTED", "UNCOMMITTED", "WRITE", "ONLY", "NOT", "DEFERRABLE", "AND", "NO",
                                "CHAIN"})
_DISCARD = frozenset({"ALL", "PLANS", "SEQUENCES", "TEMP", "TEMPORARY"})
_OBJECT_WORDS = frozenset({"TEMP", "TEMPORARY", "OR", "REPLACE", "UNLOGGED", "MATERIALIZED", "RECURSIVE", "VIEW",
                           "TABLE", "FUNCTION", "PROCEDURE", "INDEX", "SCHEMA", "ROLE", "USER", "SEQUENCE", "TYPE",
                           "EXTENSION", "TRIGGER", "RULE", "POLICY", "DATABASE", "STATISTICS", "AGGREGATE",
                           "DOMAIN", "SERVER", "PUBLICATION", "SUBSCRIPTION", "EVENT", "FOREIGN", "GLOBAL",
                           "LOCAL", "UNIQUE", "OPERATOR", "CAST", "COLLATION", "CONVERSION", "LANGUAGE",
                           "TABLESPACE", "TEXT", "SEARCH", "DEFAULT", "PRIVILEGES", "OWNED", "BY"})

DP_SETTING_NAMES = frozenset({"anonproxy.epsilon", "anonproxy.delta"})
# Below this every answer is noise; a floor also keeps a typo (1e-9 for 1e-1) from wasting a query.
MIN_SESSION_EPSILON = Decimal("0.000001")

# Statement kinds with a specific explanation: first word -> (what, why, hint).
_PREPARE_HINT = "Use the extended query protocol (Parse/Bind/Execute), as drivers do for parameters."
_SPECIAL: dict[str, tuple[str, str, str]] = {
    "COPY": ("COPY", "it reads or writes whole tables", "Query aggregates with SELECT instead."),
    "PREPARE": ("SQL-level PREPARE", "prepared statements go through the protocol", _PREPARE_HINT),
    "EXECUTE": ("SQL-level EXECUTE", "prepared statements go through the protocol", _PREPARE_HINT),
    "DO": ("DO", "procedural code can read anything", ALLOWED_HINT),
    "CALL": ("CALL", "procedures can read anything", ALLOWED_HINT),
    "INSERT": ("INSERT", "data modification", ALLOWED_HINT),
    "UPDATE": ("UPDATE", "data modification", ALLOWED_HINT),
    "DELETE": ("DELETE", "data modification", ALLOWED_HINT),
    "MERGE": ("MERGE", "data modification", ALLOWED_HINT),
    "TRUNCATE": ("TRUNCATE", "data modification", ALLOWED_HINT),
}


def statement_kind(statement: Statement) -> str:
    """A readable name for the statement kind: its leading keywords."""
    words = statement.words(6)
    if not words or words[0] is None:
        return "this statement"
    kind = [words[0]]
    if words[0] in ("CREATE", "ALTER", "DROP", "COMMENT", "SECURITY", "REFRESH", "IMPORT"):
        for word in words[1:]:
            if word is None or word not in _OBJECT_WORDS | {"ON", "LABEL", "VIEW", "MATERIALIZED"}:
                break
            kind.append(word)
    return " ".join(kind)


def refuse_statement(statement: Statement, mode: str) -> Exception:
    word = statement.word(0) or ""
    if word in _SPECIAL:
        what, why, hint = _SPECIAL[word]
        return forbidden(f"{what} is not allowed for roles in {mode} mode: {why}", hint)
    return forbidden(f"{statement_kind(statement)} is not allowed for roles in {mode} mode", ALLOWED_HINT)


def is_query(statement: Statement) -> bool:
    return statement.word(0) in QUERY_STARTS or statement.tokens[0].token_type == TokenType.L_PAREN


def classify_command(statement: Statement, mode: str) -> Decision:
    """The decision for a statement that is neither a query nor EXPLAIN; raises a Refusal when not allowed."""
    words = statement.words()
    first = words[0]
    if first == "SET":
        return _set(statement, words, mode)
    if first == "RESET":
        return _reset(statement, words, mode)
    if first == "SHOW":
        return _show(statement)
    if first in ("BEGIN", "START", "COMMIT", "END", "ROLLBACK", "ABORT"):
        return _transaction(statement, words, mode)
    if first in ("SAVEPOINT", "RELEASE"):
        return _savepoint(statement, words, mode)
    if first == "DISCARD" and len(words) == 2 and words[1] in _DISCARD:
        return Pass(resets_session=words[1] == "ALL")
    if first == "DEALLOCATE" and 2 <= len(words) <= 3 and (len(words) == 2 or words[1] == "PREPARE"):
        return Pass(deallocates=_deallocated(statement))
    if first in ("LISTEN", "UNLISTEN") and len(words) == 2:
        return Pass()
    raise refuse_statement(statement, mode)


def _deallocated(statement: Statement) -> Deallocate:
    """What ``DEALLOCATE [PREPARE] name | ALL`` names: a quoted name as written, a bare one folded to lower case."""
    last = len(statement.tokens) - 1
    token = statement.tokens[last]
    if token.token_type == TokenType.IDENTIFIER:
        return Deallocate(fold(token.text, quoted=True))
    return Deallocate(None if statement.word(last) == "ALL" else fold(statement.raw(last), quoted=False))


def _setting_name(statement: Statement, first: int) -> tuple[str, int]:
    """A (possibly dotted, possibly quoted) setting name starting at token ``first``; returns (name, next index)."""
    parts = []
    index = first
    while index < len(statement.tokens):
        token = statement.tokens[index]
        word = statement.word(index)
        if token.token_type == TokenType.IDENTIFIER:
            parts.append(token.text.lower())
        elif word is not None:
            parts.append(word.lower())
        else:
            break
        index += 1
        if index < len(statement.tokens) and statement.tokens[index].token_type == TokenType.DOT:
            index += 1
            continue
        break
    if not parts:
        raise unsupported("expected a setting name", ALLOWED_HINT)
    return ".".join(parts), index


def _value(statement: Statement, index: int) -> str | None:
    """The single value after TO / = (lower case), or None when the value is anything else."""
    if index < len(statement.tokens) and (statement.word(index) == "TO"
                                          or statement.tokens[index].token_type == TokenType.EQ):
        index += 1
    if index != len(statement.tokens) - 1:
        return None
    token = statement.tokens[index]
    if token.token_type in (TokenType.STRING, TokenType.IDENTIFIER):
        return token.text.lower()
    word = statement.word(index)
    return word.lower() if word is not None else None


def explained_query(sql: str) -> str | None:
    """The query of a message that is exactly one ``EXPLAIN (ANONPROXY) <query>``, else None."""
    if "anonproxy" not in sql.lower():
        return None  # most statements: no need to tokenize
    try:
        statements = split(sql)
    except Refusal:
        return None
    if len(statements) != 1:
        return None
    statement = statements[0]
    if statement.words(4) != ["EXPLAIN", None, "ANONPROXY", None] or len(statement.tokens) < 5:
        return None
    if statement.tokens[1].token_type != TokenType.L_PAREN or statement.tokens[3].token_type != TokenType.R_PAREN:
        return None
    return statement.span(4, len(statement.tokens))


def _dp_setting(name: str, statement: Statement, value_index: int | None, mode: str, local: bool) -> Decision:
    """SET (value_index given) or RESET of anonproxy.epsilon / anonproxy.delta."""
    setting = name[len("anonproxy."):]
    _check_dp_mode(name, mode)
    if local:
        raise unsupported(f"SET LOCAL {name} is not supported: the setting lasts for the session",
                          f"Use SET {name} and RESET {name}.")
    if value_index is None:
        return SessionSetting(setting, None)
    if value_index < len(statement.tokens) and (statement.word(value_index) == "TO"
                                                or statement.tokens[value_index].token_type == TokenType.EQ):
        value_index += 1
    last = value_index == len(statement.tokens) - 1
    token = statement.tokens[value_index] if last else None
    if token is not None and statement.word(value_index) == "DEFAULT":
        return SessionSetting(setting, None)
    text = token.text if token is not None and token.token_type in (TokenType.NUMBER, TokenType.STRING) else None
    shown = statement.span(value_index, len(statement.tokens)) if value_index < len(statement.tokens) else ""
    return SessionSetting(setting, _dp_value(name, text, shown))


def _dp_value(name: str, text: str | None, shown: str) -> Decimal:
    """The value of anonproxy.epsilon / anonproxy.delta written ``text`` (None: not a number or string)."""
    try:
        value = Decimal(text) if text is not None else None
    except InvalidOperation:
        value = None
    epsilon = name == "anonproxy.epsilon"
    if value is None or not value.is_finite() or not (value >= MIN_SESSION_EPSILON if epsilon else 0 <= value < 1):
        allowed = f"a number of at least {MIN_SESSION_EPSILON}" if epsilon else "a number in [0, 1)"
        raise Refusal(INVALID_PARAMETER_VALUE, f'invalid value for parameter "{name}": "{shown}"',
                      f"{name} takes {allowed}, at most the policy's per-query value.")
    return value


def login_setting(name: str, value: str, mode: str) -> SessionSetting | None:
    """A setting a client gave at login (``options=-c name=value`` or a startup parameter), checked as ``SET name
    TO 'value'`` after login would be in ``mode``: a Refusal for what that SET would refuse; the SessionSetting of
    ``anonproxy.epsilon`` / ``anonproxy.delta`` in dp mode, which the proxy applies itself; None for an ordinary
    setting, which PostgreSQL applies."""
    name = name.lower()
    if name in DP_SETTING_NAMES:
        _check_dp_mode(name, mode)
        return SessionSetting(name[len("anonproxy."):], _dp_value(name, value, value))
    _check_name(name, mode)
    # client_encoding and standard_conforming_strings are checked on the values the server reports once it applied
    # the login's settings (anonproxy.proxy.session), exact however a driver spells them ('utf-8', quoted, ...).
    return None


def _check_dp_mode(name: str, mode: str) -> None:
    if mode != "dp":
        raise forbidden(f"{name} applies to roles in dp mode only", "Read the policy with SHOW anonproxy.mode.")


def _check_setting(name: str, statement: Statement, value_index: int | None, mode: str) -> None:
    _check_name(name, mode)
    if value_index is not None:
        _check_value(name, _value(statement, value_index))


def _check_name(name: str, mode: str) -> None:
    if name in _IDENTITY_SETTINGS:
        raise forbidden(f"changing {name} is not allowed for roles in {mode} mode",
                        "Connect as the role you need; the proxy applies its policy by login role.")
    if name.startswith("anonproxy."):
        raise forbidden(f"{name} is set by the anonproxy policy, not by the session",
                        "Read it with SHOW anonproxy.<name>; ask the DBA to change the policy.")


def _check_value(name: str, value: str | None) -> None:
    """``value``: the lower-case value, None when it is not a single word or string."""
    if name == "client_encoding" and value not in _UTF8:
        raise unsupported("client_encoding other than UTF8 is not supported through anonproxy",
                          "Use client_encoding UTF8.")
    if name == "standard_conforming_strings" and value not in _ON:
        raise unsupported("standard_conforming_strings must stay on through anonproxy",
                          "Use E'...' strings for backslash escapes.")


def _set(statement: Statement, words: list[str | None], mode: str) -> Decision:
    if words[1:3] == ["SESSION", "AUTHORIZATION"]:
        _check_setting("session_authorization", statement, None, mode)
    if words[1:3] == ["SESSION", "CHARACTERISTICS"] or words[1:2] == ["TRANSACTION"]:
        return Pass()
    index = 2 if words[1:2] in (["SESSION"], ["LOCAL"]) else 1
    if index >= len(words):
        raise unsupported("incomplete SET", ALLOWED_HINT)
    word = words[index]
    if word == "ROLE":
        _check_setting("role", statement, None, mode)
    if words[index:index + 2] == ["SESSION", "AUTHORIZATION"]:
        _check_setting("session_authorization", statement, None, mode)
    if words[index:index + 2] in (["TIME", "ZONE"], ["XML", "OPTION"]) or word in ("SCHEMA", "CONSTRAINTS"):
        return Pass()
    if word == "NAMES":
        _check_setting("client_encoding", statement, index + 1, mode)
        return Pass()
    name, after = _setting_name(statement, index)
    if name in DP_SETTING_NAMES:
        return _dp_setting(name, statement, after, mode, local=words[1] == "LOCAL")
    _check_setting(name, statement, after, mode)
    return Pass()


def _reset(statement: Statement, words: list[str | None], mode: str) -> Decision:
    if words[1:] == ["ALL"]:
        return Pass(resets_session=True)
    if words[1:3] == ["SESSION", "AUTHORIZATION"]:
        _check_setting("session_authorization", statement, None, mode)
    name, after = _setting_name(statement, 1)
    if after != len(statement.tokens):
        raise unsupported("malformed RESET", ALLOWED_HINT)
    if name in DP_SETTING_NAMES:
        return _dp_setting(name, statement, None, mode, local=False)
    _check_setting(name, statement, None, mode)
    return Pass()


def _show(statement: Statement) -> Decision:
    name, after = _setting_name(statement, 1)
    if name.startswith("anonproxy."):
        setting = name[len("anonproxy."):]
        if after != len(statement.tokens) or not _SETTING_NAME.fullmatch(setting):
            raise unsupported(f"unknown anonproxy setting {setting!r}", "SHOW anonproxy.k, SHOW anonproxy.mode, ...")
        return Intercept(setting)
    return Pass()


def _transaction(statement: Statement, words: list[str | None], mode: str) -> Decision:
    if words[1:2] == ["PREPARED"]:
        raise forbidden(f"two-phase commit is not allowed for roles in {mode} mode", ALLOWED_HINT)
    rest = words[1:]
    if words[0] == "START":
        if rest[:1] != ["TRANSACTION"]:
            raise refuse_statement(statement, mode)
        rest = rest[1:]
    if words[0] in ("ROLLBACK", "ABORT") and "TO" in rest:
        return _savepoint(statement, words, mode)
    for index, word in enumerate(rest, start=len(words) - len(rest)):
        if word in _TRANSACTION_WORDS:
            continue
        if statement.tokens[index].token_type == TokenType.COMMA:
            continue
        raise unsupported(f"unexpected {statement.raw(index)!r} in {words[0]}", ALLOWED_HINT)
    return Pass() if words[0] in ("BEGIN", "START") else Pass(transaction=TransactionControl(Control.END))


_SAVEPOINT_CONTROLS = {"SAVEPOINT": Control.SAVEPOINT, "RELEASE": Control.RELEASE, "ROLLBACK": Control.ROLLBACK_TO,
                       "ABORT": Control.ROLLBACK_TO}


def _savepoint(statement: Statement, words: list[str | None], mode: str) -> Decision:
    # SAVEPOINT name | RELEASE [SAVEPOINT] name | ROLLBACK [WORK|TRANSACTION] TO [SAVEPOINT] name
    index = 1
    while index < len(words) - 1 and words[index] in ("WORK", "TRANSACTION", "TO", "SAVEPOINT"):
        index += 1
    token = statement.tokens[index] if index < len(statement.tokens) else None
    if token is None or index != len(statement.tokens) - 1 or (
            token.token_type != TokenType.IDENTIFIER and words[index] is None):
        raise unsupported(f"malformed {words[0]}", ALLOWED_HINT)
    return Pass(transaction=TransactionControl(_SAVEPOINT_CONTROLS[cast(str, words[0])], cursor_name(statement, index)))


# --- cursors ------------------------------------------------------------------

NAME_BYTES = 63  # PostgreSQL truncates longer identifiers (NAMEDATALEN - 1)
_INT4 = 2**31 - 1
_CURSOR_OPTIONS = frozenset({"BINARY", "INSENSITIVE", "ASENSITIVE", "SCROLL", "NO"})
_FROM_IN = frozenset({"FROM", "IN"})


@dataclass(frozen=True)
class DeclareSyntax:
    """What DECLARE says besides its query, which starts at token ``query``."""

    name: str
    binary: bool
    scroll: bool
    hold: bool
    query: int


def cursor_name(statement: Statement, index: int) -> str:
    """The cursor name at token ``index``, folded and truncated as PostgreSQL does."""
    token = statement.tokens[index] if index < len(statement.tokens) else None
    if token is not None and token.token_type == TokenType.IDENTIFIER:
        name = fold(token.text, True)
    elif statement.word(index) is not None:
        name = fold(statement.raw(index), False)
    else:
        raise _syntax(statement, index)
    return name.encode()[:NAME_BYTES].decode(errors="ignore")


def declare_cursor(statement: Statement) -> DeclareSyntax:
    """``DECLARE name [BINARY] [ASENSITIVE | INSENSITIVE] [[NO] SCROLL] CURSOR [{WITH | WITHOUT} HOLD] FOR query``
    (PostgreSQL takes the options in any order)."""
    name = cursor_name(statement, 1)
    index = 2
    seen: set[str] = set()
    binary = scroll = False
    while statement.word(index) in _CURSOR_OPTIONS:
        word = cast(str, statement.word(index))  # one of _CURSOR_OPTIONS
        if word == "NO":
            if statement.word(index + 1) != "SCROLL":
                raise _syntax(statement, index)
            word, index = "NO SCROLL", index + 1
        if word in seen or {word, *seen} >= {"SCROLL", "NO SCROLL"} or {word, *seen} >= {"INSENSITIVE", "ASENSITIVE"}:
            raise Refusal(INVALID_CURSOR_DEFINITION if "SCROLL" in word else SYNTAX_ERROR, "cannot specify both or repeated cursor "
                          f"options near {statement.raw(index)!r}", PARSE_HINT)
        seen.add(word)
        binary |= word == "BINARY"
        scroll |= word == "SCROLL"
        index += 1
    if statement.word(index) != "CURSOR":
        raise _syntax(statement, index)
    index += 1
    hold = False
    if statement.word(index) in ("WITH", "WITHOUT") and statement.word(index + 1) == "HOLD":
        hold = statement.word(index) == "WITH"
        index += 2
    if statement.word(index) != "FOR" or index + 1 >= len(statement.tokens):
        raise _syntax(statement, index)
    return DeclareSyntax(name, binary, scroll, hold, index + 1)


def cursor_command(statement: Statement) -> FetchCursor | CloseCursor:
    """FETCH / MOVE [direction] [FROM | IN] name, CLOSE name | ALL."""
    words = statement.words()
    if words[0] == "CLOSE":
        if len(words) != 2:
            raise _syntax(statement, min(len(words), 2))
        return CloseCursor(None if words[1] == "ALL" else cursor_name(statement, 1))
    move = words[0] == "MOVE"
    index = 1
    direction = "forward"
    count: int | None = 1
    word = statement.word(index)
    signed = _signed_integer(statement, index)
    if signed is not None:
        count, index = signed
    elif word in ("NEXT", "PRIOR", "FIRST", "LAST"):
        direction, count = {"NEXT": ("forward", 1), "PRIOR": ("backward", 1), "FIRST": ("absolute", 1),
                            "LAST": ("absolute", -1)}[word]
        index += 1
    elif word == "ALL":
        count, index = None, index + 1
    elif word in ("ABSOLUTE", "RELATIVE"):
        signed = _signed_integer(statement, index + 1)
        if signed is None:
            raise _syntax(statement, index + 1)
        direction, (count, index) = word.lower(), signed
    elif word in ("FORWARD", "BACKWARD"):
        direction, index = word.lower(), index + 1
        if statement.word(index) == "ALL":
            count, index = None, index + 1
        else:
            signed = _signed_integer(statement, index)
            if signed is not None:
                count, index = signed
    if statement.word(index) in _FROM_IN:
        index += 1
    elif index == 1 and index + 1 < len(statement.tokens):
        raise _syntax(statement, index + 1)
    if index != len(statement.tokens) - 1:
        raise _syntax(statement, min(index + 1, len(statement.tokens) - 1))
    return FetchCursor(cursor_name(statement, index), direction, count, move)


def _signed_integer(statement: Statement, index: int) -> tuple[int, int] | None:
    """An optionally signed integer at token ``index``, and the index after it."""
    sign = 1
    tokens = statement.tokens
    if index < len(tokens) and tokens[index].token_type in (TokenType.DASH, TokenType.PLUS):
        sign = -1 if tokens[index].token_type == TokenType.DASH else 1
        index += 1
    if index >= len(tokens) or tokens[index].token_type != TokenType.NUMBER or not statement.raw(index).isdigit():
        return None
    value = sign * int(statement.raw(index))
    if abs(value) > _INT4:
        raise _syntax(statement, index)
    return value, index + 1


def _syntax(statement: Statement, index: int) -> Refusal:
    near = statement.raw(index) if index < len(statement.tokens) else "end of input"
    return Refusal(SYNTAX_ERROR, f"syntax error at or near {near!r}", PARSE_HINT)
