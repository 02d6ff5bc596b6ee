"""The values of a Bind where its statement needs constants (route.decision.AtBind): the text of its value class.

A Bind gives each parameter a value in text or binary format, typed by the statement's Parse (0: unspecified).
The values of the statement's slots (anonproxy.plan.bind_values) are read here — text as it is, binary for the
types a client binds there (text and varchar, the integers, the floats, numeric, boolean, date, timestamp and
timestamptz) — and the statement is written again with them as constants (``class_text``). That text is decided
like any other and cached by the session under it, so a value class is analysed once per worker, as PostgreSQL
plans a custom plan for each.

What runs keeps the client's Bind: the values it does not read any more (the slots') still go with it, so the
statement prepared for the service gives those parameters a type (``service_types``: the declared one, else the
one PostgreSQL infers there), which is also what a Describe before Bind reports.
"""

from __future__ import annotations

import math
import struct
from datetime import date, datetime, timedelta

from psycopg.types.numeric import NumericBinaryLoader

from ..plan.bind_values import Slot, bound_text
from ..plan.refusals import Refusal, Reject
from ..route.decision import AtBind
from .cache import BoundedCache
from .gate_routes import Parameters, parameter_types

_TEXTS = frozenset({0, 25, 1043, 705, 1042, 19})  # binary format: the UTF-8 bytes
_INTEGERS = {21: "!h", 23: "!i", 20: "!q"}
_FLOATS = {700: "!f", 701: "!d"}
_NUMERIC_OID = 1700
_NUMERIC = NumericBinaryLoader(_NUMERIC_OID)
_NUMERIC_SIGNS = frozenset({0x0000, 0x4000, 0xC000, 0xD000, 0xF000})  # +, -, NaN, +Infinity, -Infinity
_TIMES = {1082: "!i", 1114: "!q", 1184: "!q"}  # days (date), microseconds (timestamps) since 2000-01-01
_EPOCH = datetime(2000, 1, 1)
_CLASS_TEXTS = BoundedCache[tuple[str, tuple[tuple[int, str | None, int], ...]], str](4 << 20)


def class_text(statement: AtBind, parameters: Parameters) -> str | Reject:
    """The statement with the Bind's values of its slots written as constants; a Reject for a value that cannot
    be read here (or written as a constant)."""
    values: list[tuple[int, str | None, int]] = []
    for slot in statement.slots:
        value = _value(slot, parameters)
        if isinstance(value, Reject):
            return value
        values.append((slot.number, value, _declared(slot, parameters)))
    key = (statement.sql, tuple(values))
    text = _CLASS_TEXTS.get(key)
    if text is None:
        try:
            text = bound_text(statement.sql, key[1])
        except Refusal as refusal:
            return refusal.reject
        _CLASS_TEXTS.put(key, text, len(statement.sql) + len(text))
    return text


def service_rest(statement: AtBind, rest: bytes) -> bytes:
    """The parameter types (a Parse message's part after its text) to prepare the statement with for the service:
    the client's, and for each slot left unspecified the type PostgreSQL infers there (its value is no longer
    read, but still bound)."""
    declared = parameter_types(rest)
    types = list(declared) + [0] * max(0, max(slot.number for slot in statement.slots) - len(declared))
    for slot in statement.slots:
        if not types[slot.number - 1]:
            types[slot.number - 1] = slot.type_oid
    return struct.pack(f"!h{len(types)}I", len(types), *types)


def _declared(slot: Slot, parameters: Parameters) -> int:
    return parameters.types[slot.number - 1] if slot.number <= len(parameters.types) else 0


def _value(slot: Slot, parameters: Parameters) -> str | None | Reject:
    """A slot's bound value as text (None: NULL)."""
    if slot.number > len(parameters.values):
        return Reject("08P01", f"bind message supplies {len(parameters.values)} parameters, but the statement "
                               f"needs parameter ${slot.number}")
    raw = parameters.values[slot.number - 1]
    if raw is None:
        return None
    oid = _declared(slot, parameters) or slot.type_oid
    if parameters.formats[slot.number - 1] == 1 and oid not in _TEXTS:
        return _binary(slot, oid, raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Reject("22021", f"invalid byte sequence for encoding \"UTF8\" in parameter ${slot.number}")
    if "\0" in text:
        return Reject("22021", "invalid byte sequence for encoding \"UTF8\": 0x00")
    return text


def _binary(slot: Slot, oid: int, raw: bytes) -> str | Reject:
    """A binary value of a number or boolean type, as PostgreSQL would print it."""
    layout = _INTEGERS.get(oid) or _FLOATS.get(oid) or _TIMES.get(oid) or ("!?" if oid == 16 else None)
    moment = _moment(oid, raw) if oid in _TIMES and struct.calcsize(_TIMES[oid]) == len(raw) else None
    if moment is not None:
        return moment
    if oid == _NUMERIC_OID:
        return _numeric(slot, raw)
    if layout is None or struct.calcsize(layout) != len(raw) or oid in _TIMES:
        return Reject("0A000", f"parameter ${slot.number} is bound in binary format as type OID {oid}, which "
                               "anonproxy does not read where the statement needs a constant",
                      "Bind it in text format.")
    (number,) = struct.unpack(layout, raw)
    if isinstance(number, bool):
        return "true" if number else "false"
    if isinstance(number, float) and not math.isfinite(number):
        return "NaN" if math.isnan(number) else "Infinity" if number > 0 else "-Infinity"
    return repr(number)


def _numeric(slot: Slot, raw: bytes) -> str | Reject:
    """A binary numeric (asyncpg's Decimal, beside avg()) as PostgreSQL prints it (NaN and Infinity spelled so),
    after the checks of PostgreSQL's numeric_recv, with its errors: a header of four int16 (digit count, weight,
    sign, display scale), then the base-10000 digits."""
    if len(raw) < 8 or len(raw) < 8 + 2 * max(0, struct.unpack_from("!h", raw)[0]):
        return Reject("08P01", "insufficient data left in message")
    count, _, sign, scale = struct.unpack_from("!hhHh", raw)
    digits = struct.unpack_from(f"!{max(0, count)}h", raw, 8)
    if not 0 <= count <= 3000:  # NUMERIC_MAX_PRECISION + NUMERIC_MAX_RESULT_SCALE
        return Reject("22P03", 'invalid length in external "numeric" value')
    if sign not in _NUMERIC_SIGNS:
        return Reject("22P03", 'invalid sign in external "numeric" value')
    if any(not 0 <= digit < 10000 for digit in digits):
        return Reject("22P03", 'invalid digit in external "numeric" value')
    if not 0 <= scale <= 0x3FFF:  # NUMERIC_DSCALE_MASK
        return Reject("22P03", 'invalid scale in external "numeric" value')
    if len(raw) != 8 + 2 * count:
        return Reject("22P03", f"incorrect binary data format in bind parameter {slot.number}")
    return str(_NUMERIC.load(raw))


def _moment(oid: int, raw: bytes) -> str | None:
    """A binary date, timestamp or timestamptz as PostgreSQL reads it back in text (timestamptz in UTC: +00);
    None past the years Python's datetime holds."""
    (number,) = struct.unpack(_TIMES[oid], raw)
    bits = 8 * len(raw) - 1
    if number in (2**bits - 1, -(2**bits)):
        return "infinity" if number > 0 else "-infinity"
    try:
        if oid == 1082:
            return (date(2000, 1, 1) + timedelta(days=number)).isoformat()
        moment = _EPOCH + timedelta(microseconds=number)
    except OverflowError:
        return None
    return moment.isoformat(" ") + ("+00" if oid == 1184 else "")
