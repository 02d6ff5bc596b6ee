"""Time for the no-error proof: where dates and timestamps may lie, and what each time function may do to them.

The proof (:mod:`anonproxy.plan.bounds`) tracks a date, timestamp or
timestamptz value as the interval of its finite values, in microseconds since
2000-01-01 00:00 (PostgreSQL's own epoch; a timestamptz in UTC, a date at its
midnight), plus whether it may be ±infinity. PostgreSQL raises "timestamp out
of range" (or "date out of range") when a truncation, a time zone shift or
interval arithmetic leaves its range, 4714-11-24 BC to 294276-12-31 AD; on
±infinity these functions give ±infinity without error, while extract() gives
±Infinity, which no integer cast accepts.

Where the values come from:

* a column with declared bounds (ColumnPolicy.earliest/latest) holds values
  within them, and no infinity;
* a column without is taken to hold values between 2000 BC and 200000 AD, or
  ±infinity (:data:`ASSUMED`): PostgreSQL accepts older and later values, but
  no real record holds them, and the margin to its limits is what lets a
  truncation, a time zone or a constant interval of up to centuries pass
  without declared bounds; a shift that could leave the range is refused with a
  hint to declare bounds (dp mode assumes nothing of the data in its conditions:
  there such a column may hold anything PostgreSQL holds, ColumnFacts.whole_range);
* the statement-stable clock (now(), current_timestamp ...) lies within
  :data:`CLOCK`, a finite constant for the statement.

Shifts are counted generously: a session time zone moves a local time by up to
:data:`SESSION_ZONE_SHIFT` (PostgreSQL accepts POSIX zones such as ``UTC+99``
there); a time zone named in the statement must be a name of the SERVER's tz
database (pg_timezone_names, read with the policy: Policy.zones), within a day of
UTC. Not the proxy host's: when the two differ (another host, another tzdata
version, Python's ``tzdata`` package), a name only the proxy knows would fail in
PostgreSQL only when a row reaches the call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

DAY = Decimal(86_400_000_000)  # microseconds
_EPOCH_DAYS = 730_119  # datetime(2000, 1, 1).toordinal() - 1: days from 0001-01-01 to 2000-01-01


def civil(year: int, month: int = 1, day: int = 1) -> Decimal:
    """Microseconds from 2000-01-01 to the midnight of a proleptic Gregorian date (astronomical years: 1 BC = 0)."""
    y = year - (month <= 2)
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    days = era * 146_097 + doe - 719_468  # days since 1970-01-01
    return Decimal(days - 10_957) * DAY  # 1970-01-01 is 10957 days before 2000-01-01


TS_MIN = civil(-4713, 11, 24)  # 4714-11-24 00:00 BC, PostgreSQL's earliest timestamp
TS_END = civil(294277)  # the first instant after its latest (exclusive)
DATE_END = civil(5874898)  # dates go further: up to 5874897-12-31
ASSUMED = (civil(-1999), civil(200001) - 1)  # 2000 BC to 200000 AD, for undeclared columns
CLOCK = (civil(2000), civil(2200))  # now() and the like: the server's clock is in this range
SESSION_ZONE_SHIFT = 8 * DAY  # a session TimeZone's offset, POSIX zones included (at most 167 hours)
ZONE_SHIFT = DAY  # an IANA zone's offset from UTC, local mean times included
MONTH = 31 * DAY
# How far date_trunc may move a value back (twice the unit for the long ones: PostgreSQL counts centuries and
# millennia from year 1, and BC ones backwards).
TRUNCATION: dict[str, Decimal] = {
    "microsecond": Decimal(0), "millisecond": Decimal(1000), "second": Decimal(1_000_000),
    "minute": Decimal(60_000_000), "hour": Decimal(3_600_000_000), "day": DAY, "week": 7 * DAY,
    "month": MONTH, "quarter": 3 * MONTH, "year": 366 * DAY, "decade": 2 * 10 * 366 * DAY,
    "century": 2 * 100 * 366 * DAY, "millennium": 2 * 1000 * 366 * DAY,
}  # fmt: skip
_PLURALS = {"microseconds": "microsecond", "milliseconds": "millisecond", "seconds": "second", "minutes": "minute",
            "hours": "hour", "days": "day", "weeks": "week", "months": "month", "years": "year",
            "decades": "decade", "centuries": "century", "millennia": "millennium", "millenniums": "millennium"}

# extract()/date_part() fields of each type: the range of their finite results, and whether an infinite date or
# timestamp gives ±Infinity (NULL for the others). hour/minute/second fail on a date, timezone on a timestamp.
_DATE_FIELDS: dict[str, tuple[Decimal, Decimal, bool]] = {
    "year": (Decimal(-4714), Decimal(5874898), True), "isoyear": (Decimal(-4714), Decimal(5874898), True),
    "decade": (Decimal(-472), Decimal(587490), True), "century": (Decimal(-48), Decimal(58749), True),
    "millennium": (Decimal(-5), Decimal(5875), True), "quarter": (Decimal(1), Decimal(4), False),
    "month": (Decimal(1), Decimal(12), False), "week": (Decimal(1), Decimal(53), False),
    "day": (Decimal(1), Decimal(31), False), "dow": (Decimal(0), Decimal(6), False),
    "isodow": (Decimal(1), Decimal(7), False), "doy": (Decimal(1), Decimal(366), False),
    "epoch": (Decimal("-2.2e14"), Decimal("1.9e14"), True), "julian": (Decimal(0), Decimal("2.2e9"), True),
}  # fmt: skip
_TIME_FIELDS: dict[str, tuple[Decimal, Decimal, bool]] = {
    "hour": (Decimal(0), Decimal(23), False), "minute": (Decimal(0), Decimal(59), False),
    "second": (Decimal(0), Decimal("60.999999"), False), "milliseconds": (Decimal(0), Decimal("60999.999"), False),
    "microseconds": (Decimal(0), Decimal(60_999_999), False),
}  # fmt: skip
_ZONE_FIELDS: dict[str, tuple[Decimal, Decimal, bool]] = {
    "timezone": (Decimal(-604_800), Decimal(604_800), False), "timezone_hour": (Decimal(-168), Decimal(168), False),
    "timezone_minute": (Decimal(-59), Decimal(59), False),
}  # fmt: skip
_FIELD_PLURALS = {"years": "year", "months": "month", "days": "day", "hours": "hour", "minutes": "minute",
                  "seconds": "second", "millisecond": "milliseconds", "microsecond": "microseconds",
                  "decades": "decade", "centuries": "century", "millennia": "millennium"}


def folded(name: str) -> str:
    """A unit, field or zone name as PostgreSQL matches it: ASCII letters lowered, nothing else changed (Python's
    lower() also maps some other letters to ASCII ones, the Kelvin sign to k: PostgreSQL knows no such name, and
    fails on it only when a row reaches the call)."""
    return name.lower() if name.isascii() else name


def truncation_unit(name: str) -> str | None:
    """date_trunc's unit, singular; None when PostgreSQL does not know it."""
    unit = folded(name)
    unit = _PLURALS.get(unit, unit)
    return unit if unit in TRUNCATION else None


def extract_fields(kind: str) -> dict[str, tuple[Decimal, Decimal, bool]]:
    """The extract()/date_part() fields valid for a value of ``kind`` (date, timestamp, timestamptz)."""
    if kind == "date":
        return _DATE_FIELDS
    if kind == "timestamp":
        return _DATE_FIELDS | _TIME_FIELDS
    return _DATE_FIELDS | _TIME_FIELDS | _ZONE_FIELDS


def extract_field(name: str) -> str:
    field = folded(name)
    return _FIELD_PLURALS.get(field, field)


ALL_FIELDS = frozenset(_DATE_FIELDS) | frozenset(_TIME_FIELDS) | frozenset(_ZONE_FIELDS) | frozenset(_FIELD_PLURALS)
ALL_UNITS = frozenset(TRUNCATION) | frozenset(_PLURALS)


# The zones accepted when the server's list was not read (a policy built in memory): GMT is built into PostgreSQL,
# UTC is in every tz database and in its default abbreviations.
WITHOUT_SERVER_LIST = frozenset({"utc", "gmt"})


def known_zone(name: str, zones: frozenset[str] | None) -> bool:
    """Whether ``name`` is a time zone of the server's tz database (``zones``, Policy.zones: its names in lower
    case; None: not read, then only UTC and GMT), which PostgreSQL finds whatever the row, within a day of UTC.
    Abbreviations outside it and POSIX zones (UTC+99) are not accepted: an offset may be anything there. Nor is a
    name with spaces around it: PostgreSQL does not strip them."""
    return folded(name) in (WITHOUT_SERVER_LIST if zones is None else zones)


@dataclass(frozen=True)
class Interval:
    """A constant interval: its months, days and microseconds."""

    months: int = 0
    days: int = 0
    micros: Decimal = Decimal(0)

    @property
    def sign(self) -> int:
        """1 when it can only move a timestamp later (no part negative, one positive), -1 only earlier, else 0:
        a month or a day forward is never a step back, whatever the calendar or the time zone."""
        parts = (self.months, self.days, self.micros)
        if all(part >= 0 for part in parts) and any(parts):
            return 1
        if all(part <= 0 for part in parts) and any(parts):
            return -1
        return 0

    @property
    def reach(self) -> Decimal:
        """The most it can move a timestamp (a day may be 25 hours in a time zone)."""
        return abs(self.months) * MONTH + abs(self.days) * (DAY + Decimal(3_600_000_000)) + abs(self.micros)

    @property
    def epoch_seconds(self) -> Decimal:
        """extract(epoch from it), as PostgreSQL counts: the whole years of its months (truncated toward zero) as
        365.25 days each, the months left as 30 days."""
        years = int(self.months / 12)
        days = Decimal("365.25") * years + 30 * (self.months - 12 * years) + self.days
        return days * 86400 + self.micros / 1_000_000


_UNIT_WORDS: dict[str, tuple[str, Decimal]] = {
    "microsecond": ("micros", Decimal(1)), "millisecond": ("micros", Decimal(1000)),
    "second": ("micros", Decimal(1_000_000)), "minute": ("micros", Decimal(60_000_000)),
    "hour": ("micros", Decimal(3_600_000_000)), "day": ("days", Decimal(1)), "week": ("days", Decimal(7)),
    "month": ("months", Decimal(1)), "year": ("months", Decimal(12)), "decade": ("months", Decimal(120)),
    "century": ("months", Decimal(1200)), "millennium": ("months", Decimal(12000)),
}  # fmt: skip
_ABBREVIATIONS = {"us": "microsecond", "usec": "microsecond", "usecs": "microsecond", "ms": "millisecond",
                  "msec": "millisecond", "msecs": "millisecond", "s": "second", "sec": "second", "secs": "second",
                  "m": "minute", "min": "minute", "mins": "minute", "h": "hour", "hr": "hour", "hrs": "hour",
                  "d": "day", "w": "week", "mon": "month", "mons": "month", "y": "year", "yr": "year",
                  "yrs": "year", "centuries": "century", "millennia": "millennium"}
_PAIR = re.compile(r"\s*([+-]?\d{1,9})\s*([a-z]+)\s*")
# Far below where PostgreSQL's interval fields (int32 months and days, int64 microseconds) could overflow.
MAX_INTERVAL_MONTHS = 12 * 300_000


def parse_interval(text: str) -> Interval | None:
    """A constant interval written as integer-unit pairs ('1 day', '-6 day', '2 hours 30 minutes', '1 MONTH');
    None for any other spelling (which the proof then does not rely on), and for one the session's IntervalStyle
    reads either way (:func:`read_by_interval_style`)."""
    if read_by_interval_style(text):
        return None
    months, days, micros = 0, 0, Decimal(0)
    position, found = 0, False
    source = text.lower()
    while position < len(source):
        match = _PAIR.match(source, position)
        if match is None:
            return None
        word = match.group(2)
        word = _ABBREVIATIONS.get(word, word)
        word = _PLURALS.get(word, word)
        if word not in _UNIT_WORDS:
            return None
        field, factor = _UNIT_WORDS[word]
        amount = int(match.group(1)) * factor
        if field == "months":
            months += int(amount)
        elif field == "days":
            days += int(amount)
        else:
            micros += amount
        position, found = match.end(), True
    if not found or abs(months) > MAX_INTERVAL_MONTHS or abs(days) > 31 * MAX_INTERVAL_MONTHS \
            or abs(micros) > MONTH * MAX_INTERVAL_MONTHS:
        return None
    return Interval(months, days, micros)


def read_by_interval_style(text: str) -> bool:
    """Whether PostgreSQL reads interval ``text`` one way or another as the session's IntervalStyle says: its first
    field signed with a minus, more fields, none of them signed. Under sql_standard that minus applies to every
    field ('-0 days 7000 years' is 7000 years back), under the other styles to the first only (7000 years on)."""
    signs = _FIELD_SIGN.findall(text)  # the sign of each field that is a number
    return len(signs) > 1 and signs[0] == "-" and not any(signs[1:])


_FIELD_SIGN = re.compile(r"(?<!\S)([+-]?)\d")


_ERA = re.compile(r"(.*\S)\s+(BC|AD)", re.IGNORECASE)


def infinity(text: str) -> bool:
    """Whether a date or timestamp constant is PostgreSQL's 'infinity' or '-infinity'."""
    return text.strip().lower() in ("infinity", "+infinity", "-infinity")


def literal_instant(text: str) -> Decimal | None:
    """A constant date or timestamp written as ISO 'YYYY-MM-DD[ HH:MM[:SS[.ffffff]]][+zone][ BC|AD]', in
    microseconds since 2000-01-01 (within a day, whatever the zone); None for any other spelling."""
    body, era = text.strip(), _ERA.fullmatch(text.strip())
    if era is not None:
        body = era[1]
    try:
        parsed = datetime.fromisoformat(body.replace("T", " ", 1))
    except ValueError:
        return None
    # PostgreSQL's year n BC is astronomical year 1 - n (there is no year 0).
    year = 1 - parsed.year if era is not None and era[2].upper() == "BC" else parsed.year
    return civil(year, parsed.month, parsed.day) + Decimal(
        ((parsed.hour * 60 + parsed.minute) * 60 + parsed.second) * 1_000_000 + parsed.microsecond)


def strptime(text: str, strftime_format: str) -> Decimal | None:
    """``text`` read with a strftime format (as sqlglot translates to_timestamp's), in microseconds since
    2000-01-01; None when Python's strict reading fails or the year is outside 1..9999 (PostgreSQL reads what
    Python reads strictly, and more), and for text other than ASCII: Python's digits and its case-blind
    matching are Unicode's (Arabic-Indic or fullwidth digits read as 2025), PostgreSQL's are ASCII, and it fails
    on them only when a row reaches the call."""
    if not (text.isascii() and strftime_format.isascii()):
        return None
    try:
        parsed = datetime.strptime(text, strftime_format)
    except ValueError:
        return None
    return civil(parsed.year, parsed.month, parsed.day) + Decimal(
        ((parsed.hour * 60 + parsed.minute) * 60 + parsed.second) * 1_000_000 + parsed.microsecond)


def bound_micros(moment: datetime) -> Decimal:
    """A declared bound (ColumnPolicy.earliest/latest) in microseconds since 2000-01-01 (UTC when aware)."""
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC).replace(tzinfo=None)
    return civil(moment.year, moment.month, moment.day) + Decimal(
        ((moment.hour * 60 + moment.minute) * 60 + moment.second) * 1_000_000 + moment.microsecond)
