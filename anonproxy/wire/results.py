"""Result sets the proxy answers itself, encoded as the client asks.

A :class:`Result` keeps its values in PostgreSQL's text format: that is what
the simple query protocol sends, and what the answer cache stores (the bytes of
:meth:`Result.simple`). An Execute that asks for the binary format gets each
value converted by its column's type with psycopg's adapters — load the text,
dump the binary — which know PostgreSQL's binary layouts (numeric included).
Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal

import psycopg
from psycopg import pq

from . import protocol as pg
from .framing import MessageBuffer

TEXT, BINARY = 0, 1


class FormatError(Exception):
    """A format the proxy cannot produce; carries the SQLSTATE of the error to send."""

    def __init__(self, message: str, sqlstate: str = "0A000") -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


# pg_type.typlen of the fixed-length types the proxy's own answers hold (bool, int8, int2, int4, oid, float4,
# float8, date, time, timestamp, timestamptz, interval, uuid); any other is of variable length (-1) to the proxy.
TYPE_LENGTHS = {16: 1, 20: 8, 21: 2, 23: 4, 26: 4, 700: 4, 701: 8, 1082: 4, 1083: 8, 1114: 8, 1184: 8, 1186: 16,
                2950: 16}


@dataclass(frozen=True)
class Column:
    """A result column as its RowDescription field tells it. A column PostgreSQL described keeps all of its field
    (the table and column it reads, its type length and modifier), so that drivers see what PostgreSQL said; one
    the proxy writes itself reads no table and has its type's length and no modifier."""

    name: str
    type_oid: int
    table_oid: int = 0
    attnum: int = 0
    size: int | None = None  # pg_type.typlen; None: the type's, from TYPE_LENGTHS
    typmod: int = -1

    @classmethod
    def of(cls, field: pg.Field) -> Column:
        name, table, attnum, oid, size, typmod = field
        return cls(name, oid, table, attnum, size, typmod)

    def field(self) -> pg.Field:
        size = TYPE_LENGTHS.get(self.type_oid, -1) if self.size is None else self.size
        return self.name, self.table_oid, self.attnum, self.type_oid, size, self.typmod


@dataclass(frozen=True)
class Result:
    columns: tuple[Column, ...]  # none: a command without rows (SET), answered with NoData
    rows: tuple[tuple[bytes | None, ...], ...] = ()  # text format
    tag: str = "SELECT"  # "SELECT" gets the number of rows sent appended, as PostgreSQL's does
    notices: bytes = b""  # NoticeResponse messages, sent after the rows

    def command_complete(self, count: int) -> bytes:
        return pg.command_complete(f"SELECT {count}" if self.tag == "SELECT" else self.tag)

    def description(self, formats: tuple[int, ...] | None = None) -> bytes:
        """RowDescription (NoData for a command without rows); ``formats`` as :func:`result_formats` returns."""
        if not self.columns:
            return pg.message(b"n")
        return pg.described([column.field() for column in self.columns], list(formats) if formats else None)

    def data_rows(self, formats: tuple[int, ...], start: int = 0, stop: int | None = None) -> bytes:
        """DataRow messages of rows[start:stop], each value in its column's format."""
        out = []
        for row in self.rows[start:stop]:
            out.append(pg.data_row([value if value is None or code == TEXT else binary_value(column.type_oid, value)
                                    for value, column, code in zip(row, self.columns, formats, strict=True)]))
        return b"".join(out)

    def simple(self) -> bytes:
        """The answer to a simple Query, ReadyForQuery excluded."""
        formats = (TEXT,) * len(self.columns)
        return self.description() + self.data_rows(formats) + self.command_complete(len(self.rows)) + self.notices


EXPLAIN_COLUMNS = (Column("QUERY PLAN", 25),)  # as PostgreSQL names an EXPLAIN's one text column


def explain_result(lines: Iterable[str]) -> Result:
    """An EXPLAIN answer the proxy writes itself: one text row per line."""
    return Result(EXPLAIN_COLUMNS, tuple((line.encode(),) for line in lines), "EXPLAIN")


def result_formats(codes: tuple[int, ...], width: int) -> tuple[int, ...]:
    """A Bind's result-format codes for ``width`` columns: none means text, one applies to all."""
    if len(codes) not in (0, 1, width):
        raise FormatError(f"bind message has {len(codes)} result formats but query has {width} columns", "08P01")
    expanded = codes * width if len(codes) == 1 else codes or (TEXT,) * width
    if any(code not in (TEXT, BINARY) for code in expanded):
        raise FormatError(f"unsupported format code: {next(c for c in expanded if c not in (TEXT, BINARY))}",
                          "22023")
    return expanded


def check_formats(result: Result | tuple[Column, ...], formats: tuple[int, ...]) -> None:
    """Refuse binary format for a column type the proxy cannot encode (before anything is sent)."""
    columns = result.columns if isinstance(result, Result) else result
    for column, code in zip(columns, formats, strict=True):
        if code == BINARY and (_binary_dumper(column.type_oid) is None
                               or psycopg.adapters.get_loader(column.type_oid, pq.Format.TEXT) is None):
            raise FormatError(f"anonproxy cannot send column {column.name!r} (type oid {column.type_oid}) in binary "
                              "format; ask for it in text format")


def text_value(value: object, type_oid: int) -> bytes | None:
    """A Python value as PostgreSQL prints it in a column of type ``type_oid``."""
    if value is None:
        return None
    if isinstance(value, Decimal):
        return format(value, "f").encode()  # 100, not 1E+2
    if isinstance(value, str):
        return value.encode()
    try:
        data = psycopg.adapters.get_dumper_by_oid(type_oid, pq.Format.TEXT)(type(value), None).dump(value)
    except (psycopg.ProgrammingError, TypeError, ValueError):
        data = None
    return bytes(data) if data is not None else str(value).encode()


def binary_value(type_oid: int, text: bytes) -> bytes:
    """The binary format of a value of type ``type_oid`` given in text format."""
    loader = psycopg.adapters.get_loader(type_oid, pq.Format.TEXT)
    dumper = _binary_dumper(type_oid)
    if loader is None or dumper is None:
        raise FormatError(f"anonproxy cannot send type oid {type_oid} in binary format; ask for text format")
    value = loader(type_oid, None).load(text)
    data = dumper(type(value), None).dump(value)
    if data is None:
        raise FormatError(f"anonproxy cannot send {text!r} as type oid {type_oid} in binary format")
    return bytes(data)


def _binary_dumper(type_oid: int) -> type[psycopg.abc.Dumper] | None:
    try:
        return psycopg.adapters.get_dumper_by_oid(type_oid, pq.Format.BINARY)
    except psycopg.ProgrammingError:
        return None


def parse_simple(messages: bytes) -> Result:
    """The Result whose :meth:`Result.simple` gave ``messages`` (e.g. an answer read back from the cache)."""
    columns: tuple[Column, ...] = ()
    rows: list[tuple[bytes | None, ...]] = []
    tag, notices = "SELECT", []
    for type_, body in MessageBuffer().feed(messages):
        if type_ == b"T":
            columns = tuple(map(Column.of, pg.parse_row_fields(body)))
        elif type_ == b"D":
            rows.append(pg.parse_data_row(body))
        elif type_ == b"C":
            text = pg.read_cstring(body)[0].decode()
            tag = "SELECT" if text.startswith("SELECT ") else text
        elif type_ == b"N":
            notices.append(pg.message(type_, body))
    return Result(columns, tuple(rows), tag, b"".join(notices))
