"""The sans-I/O codec, byte for byte, plus property-based fuzzing of it."""

from __future__ import annotations

import struct
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anonproxy.wire import protocol as pg
from anonproxy.wire.framing import BoundaryTracker, MessageBuffer, offsets


def test_startup_message_round_trip() -> None:
    raw = pg.startup_message({"user": "alice", "database": "db", "application_name": "psql"})
    packet, size = pg.read_startup_packet(raw + b"extra")
    assert size == len(raw)
    assert packet == pg.StartupMessage(pg.PROTOCOL_V3, {"user": "alice", "database": "db", "application_name": "psql"})
    assert packet.database == "db"


def test_startup_message_database_defaults_to_user() -> None:
    packet, _ = pg.read_startup_packet(pg.startup_message({"user": "bob"}))
    assert isinstance(packet, pg.StartupMessage) and packet.database == "bob"


def test_incomplete_packet_asks_for_more() -> None:
    raw = pg.startup_message({"user": "alice"})
    for cut in range(len(raw)):
        assert pg.read_startup_packet(raw[:cut]) == (None, 0)


def test_special_requests() -> None:
    assert pg.read_startup_packet(pg.ssl_request()) == (pg.SSLRequest(), 8)
    assert pg.read_startup_packet(struct.pack("!ii", 8, pg.GSSENC_REQUEST_CODE)) == (pg.GSSENCRequest(), 8)
    assert pg.read_startup_packet(pg.cancel_request(42, b"\xff\xff\xff\xf9")) == \
        (pg.CancelRequest(42, b"\xff\xff\xff\xf9"), 16)


@pytest.mark.parametrize(
    ("raw", "sqlstate", "words"),
    [
        (struct.pack("!i", 4) + b"\0\0\0\0", "08P01", "invalid length of startup packet"),
        (struct.pack("!i", 1 << 20), "08P01", "invalid length of startup packet"),
        (struct.pack("!ii", 8, 2 << 16), "0A000", "unsupported frontend protocol 2.0"),
        (struct.pack("!ii", 12, pg.PROTOCOL_V3) + b"user", "08P01", "expected terminator"),
        (struct.pack("!ii", 14, pg.PROTOCOL_V3) + b"user\0\0", "08P01", "has no value"),
        (struct.pack("!ii", 9, pg.PROTOCOL_V3) + b"\0", "28000", "no PostgreSQL user name"),
        (struct.pack("!ii", 17, pg.PROTOCOL_V3) + b"user\0\xff\xfe\0\0", "08P01", "UTF-8"),
    ],
)
def test_invalid_startup_packets_are_named(raw: bytes, sqlstate: str, words: str) -> None:
    with pytest.raises(pg.ProtocolViolation) as caught:
        pg.read_startup_packet(raw)
    assert caught.value.sqlstate == sqlstate
    assert words in str(caught.value)


def test_error_response_layout() -> None:
    raw = pg.error_response("42501", "permission denied", hint="ask the DBA", severity="FATAL")
    assert raw[:1] == b"E"
    (length,) = struct.unpack("!i", raw[1:5])
    assert length == len(raw) - 1
    assert raw.endswith(b"\0\0")
    fields = pg.parse_fields(raw[5:])
    assert fields == {"S": "FATAL", "V": "FATAL", "C": "42501", "M": "permission denied", "H": "ask the DBA"}


def test_backend_key_data_round_trip() -> None:
    raw = pg.backend_key_data(1 << 24 | 5, b"\xff\xfe\x1d\xc0")
    assert raw[:5] == b"K\0\0\0\x0c"
    assert pg.parse_backend_key_data(raw[5:]) == (1 << 24 | 5, b"\xff\xfe\x1d\xc0")


def test_message_buffer_splits_and_keeps_partial() -> None:
    stream = pg.message(b"R", b"\0\0\0\0") + pg.parameter_status("a", "b") + pg.ready_for_query(b"I")
    buffer = MessageBuffer()
    assert buffer.feed(stream[:7]) == []
    assert buffer.feed(stream[7:-2]) == [(b"R", b"\0\0\0\0"), (b"S", b"a\0b\0")]
    assert buffer.feed(stream[-2:] + b"Dxx") == [(b"Z", b"I")]
    assert buffer.take_rest() == b"Dxx"


def test_message_buffer_refuses_oversized_and_negative_lengths() -> None:
    with pytest.raises(pg.ProtocolViolation, match="too large"):
        MessageBuffer(max_size=100).feed(b"D" + struct.pack("!i", 1000))
    with pytest.raises(pg.ProtocolViolation, match="invalid message length"):
        MessageBuffer().feed(b"D" + struct.pack("!i", -5))


messages = st.lists(
    st.tuples(st.sampled_from([b"D", b"C", b"T", b"N", b"E", b"Z"]), st.binary(max_size=300)), min_size=1, max_size=20
)


@settings(max_examples=300, deadline=None)
@given(messages, st.lists(st.integers(min_value=0, max_value=7000), max_size=8), st.sampled_from([b"I", b"T", b"E"]))
def test_framers_follow_any_split(items: list[tuple[bytes, bytes]], cuts: list[int], status: bytes) -> None:
    """However the stream is cut into chunks, both framers agree with a whole-message parse."""
    items = [(t, b"I" if t == b"Z" else b) for t, b in items] + [(b"Z", status)]
    stream = b"".join(pg.message(t, b) for t, b in items)
    boundaries = _message_ends(stream)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    tracker, buffer = BoundaryTracker(), MessageBuffer()
    seen: list[tuple[bytes, bytes]] = []
    for start, end in pairwise(points):
        tracker.feed(stream[start:end])
        seen += buffer.feed(stream[start:end])
        assert tracker.at_boundary == (end in boundaries)
    assert seen == items
    assert tracker.idle and tracker.last_type == b"Z"


@settings(max_examples=300, deadline=None)
@given(messages)
def test_offsets_are_where_the_messages_of_the_asked_types_begin(items: list[tuple[bytes, bytes]]) -> None:
    """``offsets`` (the gate's one walk over an answer's headers) finds each ErrorResponse and ReadyForQuery where it
    was put in the stream, and nothing else, whatever bytes the bodies hold."""
    stream, expected = b"", []
    for type_, body in items:
        if type_ in (b"E", b"Z"):
            expected.append(len(stream))
        stream += pg.message(type_, body)
    assert offsets(stream, b"EZ") == expected


@settings(max_examples=300, deadline=None)
@given(messages, st.lists(st.integers(min_value=0, max_value=7000), max_size=12))
def test_tracker_state_after_every_feed(items: list[tuple[bytes, bytes]], cuts: list[int]) -> None:
    """What the relay reads of the tracker (the last message begun, whether it was a complete ReadyForQuery) is what
    a whole parse of the bytes fed so far says, wherever the stream is cut: one byte at a time, mid-header, mid-body,
    several messages at once."""
    stream = b"".join(pg.message(t, b) for t, b in items)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    tracker = BoundaryTracker()
    for start, end in pairwise(points):
        tracker.feed(stream[start:end])
        assert (tracker.last_type, tracker.idle) == _last_begun(stream[:end])


def _last_begun(prefix: bytes) -> tuple[bytes, bool]:
    """The type of the last message whose header is in ``prefix``, and whether it is a whole ReadyForQuery."""
    last_type, idle, offset = b"", True, 0
    while len(prefix) - offset >= 5:
        last_type = prefix[offset : offset + 1]
        offset += 1 + struct.unpack_from("!i", prefix, offset + 1)[0]
        idle = last_type == b"Z" and offset <= len(prefix)
    return last_type, idle


def test_tracker_refuses_an_impossible_length() -> None:
    with pytest.raises(pg.ProtocolViolation):
        BoundaryTracker().feed(b"Z\x00\x00\x00\x03I")


def _message_ends(stream: bytes) -> set[int]:
    ends, offset = {0}, 0
    while offset < len(stream):
        offset += 1 + struct.unpack_from("!i", stream, offset + 1)[0]
        ends.add(offset)
    return ends


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_startup_parser_never_fails_unexpectedly(data: bytes) -> None:
    """Arbitrary bytes either parse, ask for more, or raise ProtocolViolation."""
    try:
        packet, size = pg.read_startup_packet(data)
    except pg.ProtocolViolation as exc:
        assert exc.sqlstate in {"08P01", "0A000", "28000"}
        return
    assert (packet is None) == (size == 0)
    assert size <= len(data)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=400))
def test_framers_never_fail_unexpectedly(data: bytes) -> None:
    for framer in (MessageBuffer(max_size=1 << 16).feed, BoundaryTracker().feed):
        try:
            framer(data)
        except pg.ProtocolViolation:
            pass


@given(st.dictionaries(st.text(st.characters(blacklist_characters="\0", codec="utf-8"), min_size=1, max_size=10),
                       st.text(st.characters(blacklist_characters="\0", codec="utf-8"), max_size=10), max_size=5),
       st.text(st.characters(blacklist_characters="\0", codec="utf-8"), min_size=1, max_size=10))
def test_startup_parameters_round_trip(extra: dict[str, str], user: str) -> None:
    parameters = {**extra, "user": user}
    packet, _ = pg.read_startup_packet(pg.startup_message(parameters))
    assert isinstance(packet, pg.StartupMessage) and packet.parameters == parameters
