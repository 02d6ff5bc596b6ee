"""The answer cache's key reads the measured SQL as PostgreSQL's own scanner does (anonproxy.dp.answers.folded):
texts that PostgreSQL reads alike (keywords and bare identifiers in another case, white space, comments, a bare
identifier past 63 bytes) have one key; texts it reads differently (a string's case, a quoted identifier, a
non-ASCII letter of a bare identifier, which PostgreSQL does not fold) have different keys. Which is which is
checked against PostgreSQL's own answers over a table whose columns' names differ only there.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from anonproxy.dp.answers import folded

LONG = "c" * 63  # the longest identifier PostgreSQL keeps; longer bare names are cut to it

# Spellings PostgreSQL reads as the same statement.
ALIKE = [
    ("select a, 'x' from key_tokens", "SELECT A, 'x' FROM Key_Tokens"),
    ("select a from key_tokens where a > 0", "select  a\nfrom key_tokens /* the table */ where a>0 -- positive"),
    (f"select {LONG} from key_tokens", f"select {LONG}dd from key_tokens"),
    ('select "É" from key_tokens', 'select "É" FROM key_tokens'),
]

# Texts PostgreSQL reads differently, though they differ only in case, quotes or token boundaries.
DIFFERENT = [
    ("select 'x' from key_tokens", "select 'X' from key_tokens"),
    ('select "A" from key_tokens', "select A from key_tokens"),
    ("select É from key_tokens", "select é from key_tokens"),
    ("select 'a' || 'b c' from key_tokens", "select 'a b' || 'c' from key_tokens"),
    ("select a - -1 from key_tokens", "select a --1\nfrom key_tokens"),
]


@pytest.fixture
def table(truth: psycopg.Connection) -> Iterator[psycopg.Connection]:
    truth.execute(f'create temp table key_tokens (a int, "A" int, É int, "é" int, {LONG} int)')
    truth.execute("insert into key_tokens values (1, 2, 3, 4, 5)")
    yield truth
    truth.execute("drop table key_tokens")


def read(conn: psycopg.Connection, sql: str) -> tuple[list[str], list[tuple[object, ...]]]:
    """PostgreSQL's answer to ``sql``: its column names and rows."""
    cursor = conn.execute(sql)
    return [column.name for column in cursor.description or []], cursor.fetchall()


@pytest.mark.parametrize(("one", "other"), ALIKE)
def test_texts_postgresql_reads_alike_have_one_key(table: psycopg.Connection, one: str, other: str) -> None:
    assert read(table, one) == read(table, other)
    assert folded(one) == folded(other)


@pytest.mark.parametrize(("one", "other"), DIFFERENT)
def test_texts_postgresql_reads_differently_have_different_keys(table: psycopg.Connection, one: str,
                                                                other: str) -> None:
    assert read(table, one) != read(table, other)
    assert folded(one) != folded(other)


def test_a_text_the_scanner_refuses_is_its_own_key(table: psycopg.Connection) -> None:
    """An unterminated string, and a NUL (which would end the scanner's C string early): keyed by their text."""
    for sql in ("select 'x from key_tokens", "select 'X from key_tokens"):
        with pytest.raises(psycopg.errors.SyntaxError):
            table.execute(sql)
    assert folded("select 'x from key_tokens") != folded("select 'X from key_tokens")
    assert folded("select 1\0 from a") != folded("select 1\0 from b") != folded("select 1")
