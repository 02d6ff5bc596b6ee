"""The gate's table of protocol states and transitions (anonproxy/proxy/gate_states.py), cell by cell, without a
database; then the gate, sans-I/O, following it.

The expected table below is written from PostgreSQL's frontend/backend protocol, as its server reads a client's
messages (the documentation's "Message Flow", and the main loop of postgres.c):

* Parse, Bind, Describe, Execute and Close are the extended protocol: they open a batch, or go on with it;
* after an ErrorResponse to a message of a batch, the server ignores the batch's messages (Flush included) up to
  the Sync (``ignore_till_sync``); Sync ends the batch in every state, with ReadyForQuery;
* a Query is a batch of its own: it ends the extended one it interrupts;
* CopyData, CopyDone and CopyFail belong to a COPY, whose state the client's own server keeps (outside one, it
  ignores them); Terminate ends the session there: all four go to the client's connection;
* a message type the protocol does not know is a protocol violation (08P01), which the client's server raises;
* the proxy's own rules: a FunctionCall (fast path) is refused in every state; the parts of a Query the gate runs
  one by one (b"q", never the client's) are routed in every state.

While a failed batch is skipped, PostgreSQL ignores every message but Sync; the gate skips only the extended
protocol's, and answers or relays the others as in the other states (the one difference, kept as the gate has
always behaved: the failed batch lives only in the gate, the client's connection is not skipping).
"""

from __future__ import annotations

import struct

import pytest

from anonproxy.plan.refusals import Reject
from anonproxy.proxy.gate import Gate
from anonproxy.proxy.gate_states import (
    AFTER_ERROR,
    TRANSITIONS,
    Action,
    Kind,
    State,
    kind,
    transition,
)
from anonproxy.route.decision import Decision, Pass
from anonproxy.wire import protocol as pg
from anonproxy.wire.framing import MessageBuffer

I, B, S = State.IDLE, State.BATCH, State.SKIPPING

# type byte: (in IDLE, in BATCH, in SKIPPING), each (what the gate does, the state after).
EXPECTED: dict[bytes, tuple[tuple[Action, State], ...]] = {
    b"Q": ((Action.QUERY, I), (Action.QUERY, I), (Action.QUERY, S)),
    b"P": ((Action.PARSE, B), (Action.PARSE, B), (Action.SKIP, S)),
    b"B": ((Action.BIND, B), (Action.BIND, B), (Action.SKIP, S)),
    b"D": ((Action.BY_NAME, B), (Action.BY_NAME, B), (Action.SKIP, S)),
    b"E": ((Action.BY_NAME, B), (Action.BY_NAME, B), (Action.SKIP, S)),
    b"C": ((Action.BY_NAME, B), (Action.BY_NAME, B), (Action.SKIP, S)),
    b"S": ((Action.SYNC, I), (Action.SYNC, I), (Action.SYNC, I)),
    b"H": ((Action.FLUSH, I), (Action.FLUSH, B), (Action.SKIP, S)),
    b"F": ((Action.REFUSE_FUNCTION_CALL, I), (Action.REFUSE_FUNCTION_CALL, B), (Action.REFUSE_FUNCTION_CALL, S)),
    b"d": ((Action.RELAY, I), (Action.RELAY, B), (Action.RELAY, S)),
    b"c": ((Action.RELAY, I), (Action.RELAY, B), (Action.RELAY, S)),
    b"f": ((Action.RELAY, I), (Action.RELAY, B), (Action.RELAY, S)),
    b"X": ((Action.RELAY, I), (Action.RELAY, B), (Action.RELAY, S)),
    b"q": ((Action.SCRIPT_PART, I), (Action.SCRIPT_PART, B), (Action.SCRIPT_PART, S)),
}


@pytest.mark.parametrize("type_", sorted(EXPECTED))
@pytest.mark.parametrize("state", list(State))
def test_each_message_in_each_state(state: State, type_: bytes) -> None:
    assert transition(state, type_) == EXPECTED[type_][list(State).index(state)]


def test_the_table_has_every_state_and_kind() -> None:
    assert set(TRANSITIONS) == set(State)
    for row in TRANSITIONS.values():
        assert set(row) == set(Kind)
    assert {kind(type_) for type_ in EXPECTED} | {Kind.UNKNOWN} == set(Kind)


@pytest.mark.parametrize("state", list(State))
def test_a_type_the_protocol_does_not_know_is_a_protocol_error(state: State) -> None:
    for byte in range(256):
        type_ = bytes([byte])
        if type_ not in EXPECTED:
            assert transition(state, type_) == (Action.PROTOCOL_ERROR, state)


def test_an_error_skips_the_rest_of_the_batch() -> None:
    assert AFTER_ERROR is State.SKIPPING


# -- the gate follows the table ----------------------------------------------------------------------------------

DECISIONS: dict[str, Decision] = {"select 1": Pass(), "bad": Reject("42501", "not allowed")}


class Wires:
    def __init__(self) -> None:
        self.client = bytearray()
        self.upstream = bytearray()
        self.gate = Gate(decide=DECISIONS.__getitem__, settings=dict, write_client=self.client.extend,
                         send_upstream=self.upstream.extend, send_service=lambda data: None,
                         ask_proxy=lambda request: None)

    @staticmethod
    def types(buffer: bytearray) -> list[bytes]:
        found = [type_ for type_, _ in MessageBuffer().feed(bytes(buffer))]
        buffer.clear()
        return found


def parse(name: bytes, sql: str) -> bytes:
    return pg.message(b"P", name + b"\0" + sql.encode() + b"\0" + struct.pack("!h", 0))


def test_after_a_refusal_the_batch_is_skipped_flush_included_and_sync_answers() -> None:
    wires = Wires()
    wires.gate.client_data(parse(b"", "bad") + pg.message(b"H") + parse(b"", "select 1") + pg.message(b"S"))
    assert wires.types(wires.client) == [b"E", b"Z"]
    assert not wires.upstream, "nothing of the failed batch reaches the client's connection"
    wires.gate.client_data(parse(b"", "select 1") + pg.message(b"S"))  # the next batch is read again
    assert wires.types(wires.upstream) == [b"P", b"S"]


@pytest.mark.parametrize("type_", [b"d", b"c", b"f", b"X", b"y"])
def test_copy_messages_terminate_and_unknown_types_go_to_the_clients_connection(type_: bytes) -> None:
    wires = Wires()
    wires.gate.client_data(pg.message(type_, b"data\0"))
    assert bytes(wires.upstream) == pg.message(type_, b"data\0") and not wires.client
