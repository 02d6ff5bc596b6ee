"""The gate's protocol states and every transition between them, as data (the model is h11's ``_state.py``).

The gate reads the client's side of the frontend/backend protocol in three states:

* IDLE: no extended-protocol batch is open (nothing yet, or the last batch ended with Sync, or a Query came);
* BATCH: extended-protocol messages (Parse, Bind, Describe, Execute, Close, Flush) came since the last Sync;
* SKIPPING: an ErrorResponse answered a message of the batch: as PostgreSQL does, the batch's messages are
  ignored up to the Sync, which ends the batch with ReadyForQuery.

``TRANSITIONS`` gives, for each state and each kind of client message, what the gate does with it (an
``Action``) and the state after it; the one transition that no message triggers is ``AFTER_ERROR``. There is no
startup state (the session reads the startup packets before it opens the gate) and no COPY state: CopyData,
CopyDone and CopyFail go to the client's own connection, whose server keeps the COPY state and ignores them
outside a COPY, and so does a message of a type the protocol does not know, which that server answers with a
protocol violation (08P01) and the end of the connection.

One departure from PostgreSQL, kept as the gate has always behaved: while skipping, PostgreSQL ignores every
message but Sync, whereas the gate skips only the extended protocol's (Flush included). A Query is still answered
there, a FunctionCall refused, and COPY messages, Terminate and unknown types go to the client's connection, which
is not skipping: the failed batch lived only in the gate.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: the identity hash (Enum's own hashes the name, slowly)

    IDLE = "idle"
    BATCH = "in a batch"
    SKIPPING = "skipping to Sync"


class Kind(enum.Enum):
    """The kinds of client message, by type byte."""

    __hash__ = object.__hash__

    QUERY = b"Q"
    PARSE = b"P"
    BIND = b"B"
    DESCRIBE = b"D"
    EXECUTE = b"E"
    CLOSE = b"C"
    SYNC = b"S"
    FLUSH = b"H"
    FUNCTION_CALL = b"F"
    COPY_DATA = b"d"
    COPY_DONE = b"c"
    COPY_FAIL = b"f"
    TERMINATE = b"X"
    SCRIPT_PART = b"q"  # not the client's: one statement of a Query the gate runs part by part (cursors.ScriptRun)
    UNKNOWN = b"?"  # any other type byte


class Action(enum.Enum):
    """What the gate does with a message (each has one method in the router, routing.py)."""

    __hash__ = object.__hash__

    QUERY = enum.auto()  # decide the statement and route it
    PARSE = enum.auto()  # decide the statement and prepare it where it belongs
    BIND = enum.auto()  # bind a portal where its statement belongs
    BY_NAME = enum.auto()  # Describe, Execute, Close: to the owner of the statement or portal named
    SYNC = enum.auto()  # end the batch: to the owner of its open part, or ReadyForQuery from the gate
    FLUSH = enum.auto()  # to the owner of the batch's open part, if any
    SCRIPT_PART = enum.auto()  # route the next statement of the Query run part by part
    REFUSE_FUNCTION_CALL = enum.auto()  # 42501, with ReadyForQuery
    RELAY = enum.auto()  # to the client's own connection, outside any batch (COPY data, Terminate)
    PROTOCOL_ERROR = enum.auto()  # to the client's own connection, whose server answers 08P01 and hangs up
    SKIP = enum.auto()  # dropped: the batch failed


_EXTENDED = {Kind.PARSE: Action.PARSE, Kind.BIND: Action.BIND, Kind.DESCRIBE: Action.BY_NAME,
             Kind.EXECUTE: Action.BY_NAME, Kind.CLOSE: Action.BY_NAME}


def _row(state: State) -> dict[Kind, tuple[Action, State]]:
    """What each kind of message does in ``state`` (the table's rows differ only in a batch's messages)."""
    skipping = state is State.SKIPPING
    row = {kind: (Action.SKIP, state) if skipping else (action, State.BATCH) for kind, action in _EXTENDED.items()}
    row.update({
        Kind.QUERY: (Action.QUERY, state if skipping else State.IDLE),
        Kind.SYNC: (Action.SYNC, State.IDLE),
        Kind.FLUSH: (Action.SKIP if skipping else Action.FLUSH, state),
        Kind.SCRIPT_PART: (Action.SCRIPT_PART, state),
        Kind.FUNCTION_CALL: (Action.REFUSE_FUNCTION_CALL, state),
        Kind.COPY_DATA: (Action.RELAY, state),
        Kind.COPY_DONE: (Action.RELAY, state),
        Kind.COPY_FAIL: (Action.RELAY, state),
        Kind.TERMINATE: (Action.RELAY, state),
        Kind.UNKNOWN: (Action.PROTOCOL_ERROR, state),
    })
    return row


TRANSITIONS: dict[State, dict[Kind, tuple[Action, State]]] = {state: _row(state) for state in State}

# An ErrorResponse answered a message of the batch (a refusal, a failed answer, a batch ended by the proxy's hold
# limits): its other messages are ignored up to the Sync.
AFTER_ERROR = State.SKIPPING

_KINDS = {kind.value: kind for kind in Kind if kind is not Kind.UNKNOWN}


def kind(type_: bytes) -> Kind:
    """The kind of a client message of type byte ``type_``."""
    return _KINDS.get(type_, Kind.UNKNOWN)


def transition(state: State, type_: bytes) -> tuple[Action, State]:
    """What the gate does with a message of type ``type_`` in ``state``, and the state after it."""
    return TRANSITIONS[state][kind(type_)]
