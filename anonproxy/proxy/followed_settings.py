"""The client's session settings that a gated session's answers follow: one list, for every place that copies them.

Answers to a gated role are computed away from the client's own connection:
rewritten statements (suppress) run on a borrowed service connection, and
differentially private answers are made by the proxy. For them to print as
the client's own connection would print them, these settings are taken from
the client's session — at login (startup parameters and ``options``), and
again whenever the client changes them (``SET``, ``RESET``, a function, a
rolled-back transaction) — and applied where the answer is made.

The server reports changes of some of them with ParameterStatus; the others
it does not report, so the gate reads them with a query of its own on the
client's connection after the client ran something there.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import date, datetime, timedelta, timezone, tzinfo
from decimal import Decimal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ..wire.results import Result

# How values print: text encoding, dates and times, time zone, intervals, floating-point digits, binary strings.
FOLLOWED_SETTINGS: tuple[str, ...] = ("client_encoding", "DateStyle", "TimeZone", "IntervalStyle",
                                      "extra_float_digits", "bytea_output")
# Those the server reports (ParameterStatus) at login and on every change.
REPORTED_SETTINGS: tuple[str, ...] = ("client_encoding", "DateStyle", "TimeZone", "IntervalStyle")
# Those it does not: read with ``current_setting`` on the client's own connection.
UNREPORTED_SETTINGS: tuple[str, ...] = tuple(name for name in FOLLOWED_SETTINGS if name not in REPORTED_SETTINGS)


BYTEA, FLOAT4, FLOAT8, DATE, TIMESTAMP, TIMESTAMPTZ, INTERVAL = 17, 700, 701, 1082, 1114, 1184, 1186
_FLOAT_DIGITS = {FLOAT8: 15, FLOAT4: 6}  # DBL_DIG, FLT_DIG


def follow_settings(result: Result, settings: dict[str, str]) -> Result:
    """``result``, made by the proxy, printed as the client's settings say.

    Its values are in the proxy's own text (psycopg's: floats in shortest form, ISO dates, times with their
    offset, intervals as days and time); each float, date, timestamp, timestamptz and interval column is
    printed again the way PostgreSQL prints it under the client's extra_float_digits, DateStyle, TimeZone and
    IntervalStyle, and each bytea column under its bytea_output. Cached answers are stored in the proxy's text and
    printed on delivery.
    """
    style = _Style.of(settings)
    printers = [_PRINTERS.get(column.type_oid) for column in result.columns]
    if not any(printers):
        return result
    rows = tuple(tuple(value if value is None or printer is None else printer(value.decode(), style).encode()
                       for value, printer in zip(row, printers, strict=True)) for row in result.rows)
    return replace(result, rows=rows)


@dataclass(frozen=True)
class _Style:
    float_digits: int
    dates: str  # ISO, SQL, POSTGRES, GERMAN
    day_first: bool  # DateStyle's DMY (not MDY or YMD)
    zone: tzinfo | None  # None: a TimeZone the proxy cannot read (the offset is kept)
    intervals: str  # postgres, postgres_verbose, sql_standard, iso_8601
    bytea_hex: bool  # bytea_output hex (else escape)

    @classmethod
    def of(cls, settings: dict[str, str]) -> _Style:
        words = [word.strip().upper() for word in settings.get("DateStyle", "ISO, MDY").split(",")]
        try:
            digits = int(settings.get("extra_float_digits", "1"))
        except ValueError:
            digits = 1
        return cls(digits, words[0] if words[0] in ("ISO", "SQL", "POSTGRES", "GERMAN") else "ISO",
                   "DMY" in words or "EURO" in words or "EUROPEAN" in words, _zone(settings.get("TimeZone", "UTC")),
                   settings.get("IntervalStyle", "postgres").lower(), settings.get("bytea_output", "hex") != "escape")


def _zone(name: str) -> tzinfo | None:
    if name.upper() in ("UTC", "GMT", "Z", "ZULU"):
        return timezone.utc
    try:
        return ZoneInfo(name)
    except (ValueError, ZoneInfoNotFoundError):
        return None  # a POSIX spec such as 'UTC+3': kept as computed


def _float(text: str, style: _Style, base: int) -> str:
    """float8out/float4out: with extra_float_digits > 0 the shortest text that reads back exactly, in %g's
    layout (exponent below -4 or from DBL_DIG / FLT_DIG on); otherwise printf's %g with DBL_DIG (FLT_DIG) +
    extra_float_digits significant digits, at least 1."""
    value = float(text)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if style.float_digits <= 0:
        return "%.*g" % (max(base + style.float_digits, 1), value)
    shortest = repr(value) if base == _FLOAT_DIGITS[FLOAT8] else _float4(value)
    sign, digits, exponent = Decimal(shortest).normalize().as_tuple()
    point = len(digits) + int(exponent) - 1  # the decimal exponent of the first digit
    mantissa = "".join(map(str, digits))
    if value == 0:
        return "-0" if sign else "0"
    if -4 <= point < base:
        return ("-" if sign else "") + format(abs(Decimal(shortest)).normalize(), "f")
    return ("-" if sign else "") + (mantissa[0] + ("." + mantissa[1:] if len(mantissa) > 1 else "")
                                    + f"e{'-' if point < 0 else '+'}{abs(point):02d}")


def _float4(value: float) -> str:
    """The shortest text of a float4: the fewest significant digits that read back to the same float4."""
    packed = struct.pack("f", value)
    for precision in range(1, 10):
        text = "%.*g" % (precision, value)
        if struct.pack("f", float(text)) == packed:
            return text
    return repr(value)


_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


def _date_part(value: date, style: _Style) -> str:
    day, month, year = f"{value.day:02d}", f"{value.month:02d}", f"{value.year:04d}"
    first, second = (day, month) if style.day_first else (month, day)
    if style.dates == "SQL":
        return f"{first}/{second}/{year}"
    if style.dates == "GERMAN":
        return f"{day}.{month}.{year}"
    if style.dates == "POSTGRES":
        return f"{first}-{second}-{year}"
    return f"{year}-{month}-{day}"


def _date(text: str, style: _Style) -> str:
    return _date_part(date.fromisoformat(text), style)


def _clock(value: datetime) -> str:
    """HH:MM:SS and the fraction of a second without trailing zeros, as PostgreSQL prints them."""
    clock = f"{value.hour:02d}:{value.minute:02d}:{value.second:02d}"
    return clock + f".{value.microsecond:06d}".rstrip("0") if value.microsecond else clock


def _offset(value: datetime) -> str:
    """The numeric zone offset of ISO style: +09, +05:30, -03:00:15."""
    offset = value.utcoffset() or timedelta(0)
    sign = "-" if offset < timedelta(0) else "+"
    seconds = abs(int(offset.total_seconds()))
    hours, minutes, rest = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{sign}{hours:02d}" + (f":{minutes:02d}" if minutes or rest else "") + (f":{rest:02d}" if rest else "")


def _timestamp(text: str, style: _Style, zoned: bool = False) -> str:
    value = datetime.fromisoformat(text)
    if zoned and style.zone is not None and value.tzinfo is not None:
        value = value.astimezone(style.zone)
    if style.dates == "ISO":
        return f"{_date_part(value.date(), style)} {_clock(value)}" + (_offset(value) if zoned else "")
    zone = (" " + (value.tzname() if value.tzinfo is not None and style.zone is not None else _offset(value))
            if zoned else "")
    if style.dates == "POSTGRES":
        day_month = (f"{value.day:02d} {_MONTHS[value.month - 1]}" if style.day_first
                     else f"{_MONTHS[value.month - 1]} {value.day:02d}")
        return f"{_DAYS[value.weekday()]} {day_month} {_clock(value)} {value.year:04d}{zone}"
    return f"{_date_part(value.date(), style)} {_clock(value)}{zone}"


def _timestamptz(text: str, style: _Style) -> str:
    return _timestamp(text, style, zoned=True)


_INTERVAL = re.compile(r"(?:(-?\d+) days? )?(\d+):(\d\d):(\d\d)(?:\.(\d+))?")


def _interval(text: str, style: _Style) -> str:
    """An interval of days and time (what the proxy holds) in the client's IntervalStyle; a negative one has
    both parts negative."""
    match = _INTERVAL.fullmatch(text)
    if match is None:
        return text
    days, hours, minutes, seconds, fraction = match.groups()
    total = timedelta(days=int(days or 0), hours=int(hours), minutes=int(minutes), seconds=int(seconds),
                      microseconds=int((fraction or "0").ljust(6, "0")[:6]))
    negative = total < timedelta(0)
    total = abs(total)
    day_count, rest = total.days, total - timedelta(days=total.days)
    hour, minute = rest.seconds // 3600, rest.seconds // 60 % 60
    second, micro = rest.seconds % 60, rest.microseconds
    sign = "-" if negative else ""
    fraction_text = f".{micro:06d}".rstrip("0") if micro else ""
    if style.intervals == "iso_8601":
        if not day_count and not rest:
            return "PT0S"
        out = "P" + (f"{sign}{day_count}D" if day_count else "")
        if rest:
            out += "T" + (f"{sign}{hour}H" if hour else "") + (f"{sign}{minute}M" if minute else "")
            out += f"{sign}{second}{fraction_text}S" if second or micro else ""
        return out
    if style.intervals == "sql_standard":
        clock = f"{hour}:{minute:02d}:{second:02d}{fraction_text}"
        if day_count:  # one sign for both parts, as they share it
            return f"{sign}{day_count} {clock}"
        return f"{sign}{clock}" if rest else "0"
    if style.intervals == "postgres_verbose":
        parts = [f"{day_count} day{'s' if day_count != 1 else ''}"] if day_count else []
        for count, unit in ((hour, "hour"), (minute, "min")):
            if count:
                parts.append(f"{count} {unit}{'s' if count != 1 else ''}")
        if second or micro:
            parts.append(f"{second}{fraction_text} sec{'s' if second != 1 or micro else ''}")
        return "@ " + (" ".join(parts) if parts else "0") + (" ago" if negative else "")
    out = f"{sign}{day_count} day{'s' if day_count != 1 else ''}" if day_count else ""
    if rest or not day_count:
        clock = f"{sign}{hour:02d}:{minute:02d}:{second:02d}{fraction_text}"
        out = f"{out} {clock}" if out else clock
    return out


def _bytea(text: str, style: _Style) -> str:
    """byteaout: ``\\x`` and two hex digits a byte, or (escape) printable ASCII as it is, a backslash doubled and
    any other byte as a backslash and three octal digits. The proxy's text is either form."""
    data = bytes.fromhex(text[2:]) if text.startswith("\\x") else _unescaped(text)
    if style.bytea_hex:
        return "\\x" + data.hex()
    return "".join("\\\\" if byte == 0x5C else chr(byte) if 0x20 <= byte <= 0x7E else f"\\{byte:03o}"
                   for byte in data)


def _unescaped(text: str) -> bytes:
    """The bytes of bytea's escape form."""
    data = bytearray()
    index = 0
    while index < len(text):
        if text[index] != "\\":
            data.append(ord(text[index]))
            index += 1
        elif text[index + 1] == "\\":
            data.append(0x5C)
            index += 2
        else:
            data.append(int(text[index + 1:index + 4], 8))
            index += 4
    return bytes(data)


_PRINTERS: dict[int, Callable[[str, _Style], str]] = {
    FLOAT8: lambda text, style: _float(text, style, _FLOAT_DIGITS[FLOAT8]),
    FLOAT4: lambda text, style: _float(text, style, _FLOAT_DIGITS[FLOAT4]),
    DATE: _date, TIMESTAMP: _timestamp, TIMESTAMPTZ: _timestamptz, INTERVAL: _interval, BYTEA: _bytea,
}
