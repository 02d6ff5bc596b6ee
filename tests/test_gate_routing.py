"""The gate's routing and ordering, message by message (the gate is sans-I/O: bytes in, bytes out)."""

from __future__ import annotations

import struct

import pytest

from anonproxy.plan.refusals import Reject
from anonproxy.proxy.gate import Description, Gate, Owner, Parameters, ProxyRequest
from anonproxy.route.decision import Decision, Intercept, Noisy, Pass, Rewrite
from anonproxy.wire import protocol as pg
from anonproxy.wire.framing import MessageBuffer
from anonproxy.wire.results import Column, Result

DECISIONS: dict[str, Decision] = {
    "select 1": Pass(),
    "agg": Rewrite("rewritten agg"),
    "bad": Reject("42501", "not allowed", "do this instead"),
    "show anonproxy.k": Intercept("k"),
    "dp": Noisy("dp"),
}


class Wires:
    def __init__(self) -> None:
        self.client = bytearray()
        self.upstream = bytearray()
        self.service = bytearray()
        self.asked: list[Decision] = []
        self.gate = Gate(decide=DECISIONS.__getitem__, settings=lambda: {"k": "10"},
                         write_client=self.client.extend, send_upstream=self.upstream.extend,
                         send_service=self.service.extend, ask_proxy=self.asked.append)

    @staticmethod
    def types(buffer: bytearray) -> list[bytes]:
        messages = [t for t, _ in MessageBuffer().feed(bytes(buffer))]
        buffer.clear()
        return messages

    def upstream_says(self, *messages: tuple[bytes, bytes]) -> None:
        for type_, body in messages:
            self.gate.upstream_message(type_, body)

    def service_says(self, *messages: tuple[bytes, bytes]) -> None:
        for type_, body in messages:
            self.gate.service_message(type_, body)


def parse(name: bytes, sql: str) -> bytes:
    return pg.message(b"P", name + b"\0" + sql.encode() + b"\0" + struct.pack("!h", 0))


def bind(portal: bytes, statement: bytes) -> bytes:
    return pg.message(b"B", portal + b"\0" + statement + b"\0" + struct.pack("!hhh", 0, 0, 0))


def execute(portal: bytes = b"") -> bytes:
    return pg.message(b"E", portal + b"\0" + struct.pack("!i", 0))


SYNC = pg.message(b"S")
RESULT = ((b"T", b"x"), (b"D", b"y"), (b"C", b"SELECT 1\0"))
# A Query's rewrite runs as the service connection's prepared statement: Close (of a statement of that name left
# there), Parse, Bind, Describe, Execute, Sync the first time there; then only Bind, Describe, Execute, Sync.
PREPARED_FIRST = [b"C", b"P", b"B", b"D", b"E", b"S"]
PREPARED_AGAIN = [b"B", b"D", b"E", b"S"]
PREPARING = ((b"3", b""), (b"1", b""), (b"2", b""))  # CloseComplete, ParseComplete, BindComplete


def test_simple_queries_go_where_the_decision_says() -> None:
    wires = Wires()
    wires.gate.client_data(pg.query_message("select 1"))
    assert wires.upstream == pg.query_message("select 1") and not wires.service
    wires.upstream_says(*RESULT, (b"Z", b"T"))
    assert wires.types(wires.client) == [b"T", b"D", b"C", b"Z"]
    wires.upstream.clear()
    wires.gate.client_data(pg.query_message("agg"))
    messages = MessageBuffer().feed(bytes(wires.service))
    assert [t for t, _ in messages] == PREPARED_FIRST and not wires.upstream
    assert pg.parse_parse(messages[1][1]).query == b"rewritten agg"
    wires.service_says(*PREPARING, *RESULT, (b"S", b"x\0y\0"), (b"Z", b"I"))
    # The service's own ParameterStatus is hidden; its status is replaced by the client's ('T').
    assert bytes(wires.client).endswith(pg.ready_for_query(b"T"))
    assert wires.types(wires.client) == [b"T", b"D", b"C", b"Z"]


def test_a_query_seen_again_on_the_connection_is_only_bound_and_executed() -> None:
    wires = Wires()
    wires.gate.client_data(pg.query_message("agg"))
    first = MessageBuffer().feed(bytes(wires.service))
    wires.service.clear()
    name = pg.parse_parse(first[1][1]).statement
    assert [t for t, _ in first] == PREPARED_FIRST and name and first[0][1] == b"S" + name + b"\0"
    wires.service_says(*PREPARING, *RESULT, (b"Z", b"I"))
    wires.gate.client_data(pg.query_message("agg"))
    again = MessageBuffer().feed(bytes(wires.service))
    assert [t for t, _ in again] == PREPARED_AGAIN and pg.parse_bind(again[0][1]).statement == name
    wires.service_says((b"2", b""), *RESULT, (b"Z", b"I"))
    assert wires.types(wires.client) == [b"T", b"D", b"C", b"Z", b"T", b"D", b"C", b"Z"]


def test_an_error_of_a_prepared_query_reaches_the_client_and_it_is_prepared_again() -> None:
    wires = Wires()
    wires.gate.client_data(pg.query_message("agg"))
    wires.service.clear()
    wires.service_says((b"3", b""), (b"1", b""), (b"E", pg.error_response("57014", "canceled")[5:]), (b"Z", b"I"))
    assert wires.types(wires.client) == [b"E", b"Z"]
    wires.gate.client_data(pg.query_message("agg"))
    assert wires.types(wires.service) == PREPARED_FIRST  # its Parse may be what failed


def test_a_plan_postgresql_will_not_reuse_runs_as_a_plain_query() -> None:
    wires = Wires()
    wires.gate.client_data(pg.query_message("agg"))
    wires.service_says(*PREPARING, *RESULT, (b"Z", b"I"))
    wires.types(wires.client)
    wires.service.clear()
    wires.gate.client_data(pg.query_message("agg"))
    assert wires.types(wires.service) == PREPARED_AGAIN
    stale = pg.error_response("0A000", "cached plan must not change result type")[5:]
    wires.service_says((b"E", stale), (b"Z", b"I"))
    assert wires.types(wires.client) == []  # not the client's: the Query runs as before
    assert wires.service == pg.query_message("rewritten agg")
    wires.service.clear()
    wires.service_says(*RESULT, (b"Z", b"I"))
    assert wires.types(wires.client) == [b"T", b"D", b"C", b"Z"]
    wires.gate.client_data(pg.query_message("agg"))
    assert wires.types(wires.service) == PREPARED_FIRST


def test_a_query_behind_a_prepared_one_waits_for_its_answer() -> None:
    wires = Wires()
    wires.gate.client_data(pg.query_message("agg") + pg.query_message("agg"))
    assert wires.types(wires.service) == PREPARED_FIRST  # the second waits: the first may run again as a Query
    wires.service_says(*PREPARING, *RESULT, (b"Z", b"I"))
    assert wires.types(wires.service) == PREPARED_AGAIN
    wires.service_says((b"2", b""), *RESULT, (b"Z", b"I"))
    assert wires.types(wires.client) == [b"T", b"D", b"C", b"Z"] * 2


def test_a_query_after_an_open_batch_of_the_client_runs_as_a_plain_query() -> None:
    wires = Wires()
    wires.gate.client_data(parse(b"", "agg") + bind(b"", b"") + pg.message(b"H") + pg.query_message("agg"))
    messages = MessageBuffer().feed(bytes(wires.service))
    assert [t for t, _ in messages] == [b"P", b"B", b"H", b"Q"] and messages[-1][1] == b"rewritten agg\0"


def test_refusal_answers_locally() -> None:
    wires = Wires()
    wires.gate.client_data(pg.query_message("bad"))
    messages = MessageBuffer().feed(bytes(wires.client))
    assert [t for t, _ in messages] == [b"E", b"Z"]
    assert pg.parse_fields(messages[0][1])["H"] == "do this instead"
    assert not wires.upstream and not wires.service


def test_responses_keep_the_order_of_requests() -> None:
    wires = Wires()
    wires.gate.client_data(pg.query_message("select 1") + pg.query_message("agg") + pg.query_message("bad"))
    assert wires.upstream and not wires.service  # the rewrite waits for the upstream's answer
    assert wires.types(wires.client) == []
    wires.upstream_says(*RESULT, (b"Z", b"I"))
    assert wires.types(wires.service) == PREPARED_FIRST
    assert wires.types(wires.client) == [b"T", b"D", b"C", b"Z"]  # the refusal waits for the service
    wires.service_says(*PREPARING, *RESULT, (b"Z", b"I"))
    assert wires.types(wires.client) == [b"T", b"D", b"C", b"Z", b"E", b"Z"]


def test_a_batch_mixing_owners_is_split_with_a_sync_of_ours() -> None:
    wires = Wires()
    wires.gate.client_data(parse(b"", "select 1") + bind(b"", b"") + execute()
                           + parse(b"s", "agg") + bind(b"p", b"s") + execute(b"p") + SYNC)
    assert wires.types(wires.upstream) == [b"P", b"B", b"E", b"S"]
    assert not wires.service
    wires.upstream_says((b"1", b""), (b"2", b""), *RESULT[1:], (b"Z", b"I"))
    # Our Sync's ReadyForQuery is swallowed; the rewritten statement's Parse is answered by the gate, in turn.
    assert wires.types(wires.client) == [b"1", b"2", b"D", b"C", b"1"]
    assert wires.types(wires.service) == [b"C", b"P", b"B", b"E", b"S"]  # prepared where first used
    wires.service_says((b"3", b""), (b"1", b""), (b"2", b""), *RESULT[1:], (b"Z", b"I"))
    assert wires.types(wires.client) == [b"2", b"D", b"C", b"Z"]
    assert wires.gate.in_flight == {Owner.UPSTREAM: 0, Owner.SERVICE: 0, Owner.PROXY: 0}


def test_rewritten_parse_carries_the_new_text_and_later_messages_follow_the_statement() -> None:
    wires = Wires()
    wires.gate.client_data(parse(b"s1", "agg") + SYNC)
    assert wires.types(wires.client) == [b"1", b"Z"] and not wires.service  # answered here; prepared when used
    wires.gate.client_data(bind(b"", b"s1") + execute() + SYNC)
    messages = MessageBuffer().feed(bytes(wires.service))
    assert messages[1] == (b"P", b"s1\0rewritten agg\0" + struct.pack("!h", 0))
    assert [t for t, _ in messages] == [b"C", b"P", b"B", b"E", b"S"] and not wires.upstream


def test_refused_parse_skips_the_rest_of_the_batch() -> None:
    wires = Wires()
    wires.gate.client_data(parse(b"", "bad") + bind(b"", b"") + execute() + SYNC + pg.query_message("select 1"))
    assert wires.types(wires.client) == [b"E", b"Z"]
    assert wires.types(wires.upstream) == [b"Q"]


def test_show_in_the_extended_protocol_is_answered_locally() -> None:
    wires = Wires()
    describe_portal = pg.message(b"D", b"P\0")
    wires.gate.client_data(parse(b"", "show anonproxy.k") + bind(b"", b"") + describe_portal + execute() + SYNC)
    messages = MessageBuffer().feed(bytes(wires.client))
    assert [t for t, _ in messages] == [b"1", b"2", b"T", b"D", b"C", b"Z"]
    assert messages[3][1].endswith(b"10")
    assert not wires.upstream and not wires.service


def test_fast_path_function_calls_are_refused() -> None:
    wires = Wires()
    wires.gate.client_data(pg.message(b"F", struct.pack("!ih", 1234, 0)))
    assert wires.types(wires.client) == [b"E", b"Z"] and not wires.upstream


def test_settings_the_client_changes_follow_on_the_service_connection() -> None:
    wires = Wires()
    wires.gate.client_data(pg.query_message("select 1"))
    wires.upstream_says((b"S", b"DateStyle\0German, DMY\0"), (b"C", b"SET\0"), (b"Z", b"I"))
    assert wires.types(wires.client) == [b"S", b"C", b"Z"]
    wires.gate.client_data(pg.query_message("agg"))
    messages = MessageBuffer().feed(bytes(wires.service))
    assert messages[0] == (b"Q", b"SET DateStyle TO 'German, DMY';\0")
    assert [t for t, _ in messages[1:]] == PREPARED_FIRST
    wires.service_says((b"C", b"SET\0"), (b"Z", b"I"))  # the answer to our SET is not the client's
    assert wires.types(wires.client) == []
    wires.service_says(*PREPARING, *RESULT, (b"Z", b"I"))
    assert wires.types(wires.client) == [b"T", b"D", b"C", b"Z"]


def test_answers_the_proxy_computes_keep_their_place() -> None:
    wires = Wires()
    wires.gate.client_data(pg.query_message("dp") + pg.query_message("select 1"))
    assert wires.asked == [ProxyRequest(Noisy("dp"), sql="dp")] and not wires.upstream  # the next query waits for the answer
    wires.gate.proxy_answered(pg.command_complete("SELECT 0"))
    assert wires.types(wires.client) == [b"C", b"Z"]
    assert wires.upstream == pg.query_message("select 1")


ANSWER = Result((Column("n", 20), Column("x", 1700)), ((b"1", b"2.5"), (b"3", None), (b"5", b"-1")),
                notices=pg.error_response("00000", "ε", severity="NOTICE", type_=b"N"))


def bind_values(portal: bytes, statement: bytes, values: list[bytes], result_formats: list[int]) -> bytes:
    body = portal + b"\0" + statement + b"\0" + struct.pack("!hh", 1, 0) + struct.pack("!h", len(values))
    body += b"".join(struct.pack("!i", len(v)) + v for v in values)
    return pg.message(b"B", body + struct.pack(f"!h{len(result_formats)}h", len(result_formats), *result_formats))


def test_dp_statements_in_the_extended_protocol_are_emulated() -> None:
    wires = Wires()
    wires.gate.client_data(parse(b"s", "dp") + pg.message(b"D", b"Ss\0") + SYNC)
    assert wires.types(wires.client) == [b"1"]  # ParseComplete; Describe waits for the proxy
    assert wires.asked == [ProxyRequest(Noisy("dp"), describe=True, sql="dp")]
    wires.gate.proxy_answered(Description((23,), ANSWER.columns))
    messages = MessageBuffer().feed(bytes(wires.client))
    assert [t for t, _ in messages] == [b"t", b"T", b"Z"]
    assert messages[0][1] == struct.pack("!hI", 1, 23)
    assert pg.parse_row_description(messages[1][1]) == [("n", 20), ("x", 1700)]
    wires.client.clear()
    # Bind a value, results in binary; Execute two rows at a time: one request to the proxy, then the portal.
    wires.gate.client_data(bind_values(b"p", b"s", [b"42"], [1]) + pg.message(b"E", b"p\0" + struct.pack("!i", 2))
                           + pg.message(b"E", b"p\0" + struct.pack("!i", 2)) + SYNC)
    assert wires.types(wires.client) == [b"2"]
    assert wires.asked[-1] == ProxyRequest(Noisy("dp"), parameters=Parameters((), (0,), (b"42",)), sql="dp")
    wires.gate.proxy_answered(ANSWER)
    messages = MessageBuffer().feed(bytes(wires.client))
    assert [t for t, _ in messages] == [b"D", b"D", b"s", b"N", b"D", b"C", b"Z"]
    # numeric 2.5 in binary: 2 base-10000 digits, weight 0, sign +, display scale 1, digits 2 and 5000.
    assert pg.parse_data_row(messages[0][1]) == (struct.pack("!q", 1), struct.pack("!hhHhhh", 2, 0, 0, 1, 2, 5000))
    assert pg.parse_data_row(messages[1][1]) == (struct.pack("!q", 3), None)
    assert messages[5][1] == b"SELECT 1\0"  # the rows of that Execute
    assert len(wires.asked) == 2, "the portal's answer is asked for once"


def test_a_proxy_error_skips_the_rest_of_the_batch() -> None:
    wires = Wires()
    wires.gate.client_data(parse(b"", "dp") + bind(b"", b"") + execute() + parse(b"", "select 1") + bind(b"", b"")
                           + execute() + SYNC + pg.query_message("select 1"))
    wires.gate.proxy_answered(pg.error_response("53400", "budget exhausted"))
    assert wires.types(wires.client) == [b"1", b"2", b"E", b"Z"]
    assert wires.upstream == pg.query_message("select 1"), "the batch's upstream part was skipped, not sent"


def test_a_binary_format_the_proxy_cannot_encode_is_refused() -> None:
    wires = Wires()
    wires.gate.client_data(parse(b"", "dp") + bind_values(b"", b"", [], [1]) + execute() + SYNC)
    wires.gate.proxy_answered(Result((Column("cash", 790),), ((b"$1.00",),)))  # money: no binary adapter
    messages = MessageBuffer().feed(bytes(wires.client))
    assert [t for t, _ in messages] == [b"1", b"2", b"E", b"Z"]
    assert "binary format" in pg.parse_fields(messages[2][1])["M"]


def test_bind_messages_are_read_strictly() -> None:
    body = bind_values(b"p", b"s", [b"42", b"x"], [1, 0])[5:]
    assert pg.parse_bind(body) == pg.Bind(b"p", b"s", (0,), (b"42", b"x"), (1, 0))
    null = b"p\0s\0" + struct.pack("!hhi", 0, 1, -1) + struct.pack("!h", 0)
    assert pg.parse_bind(null).values == (None,)
    for broken in (body[:-1],  # cut short
                   body + b"\0",  # trailing bytes
                   b"p\0s\0" + struct.pack("!hhhh", 2, 0, 0, 1) + struct.pack("!i", 1) + b"x" + struct.pack("!h", 0),
                   b"p\0s\0" + struct.pack("!hhi", 0, 1, 99) + b"x" + struct.pack("!h", 0)):  # value too long
        with pytest.raises(pg.ProtocolViolation):
            pg.parse_bind(broken)


def test_describe_then_execute_of_a_portal_is_one_request() -> None:
    wires = Wires()
    describe_portal = pg.message(b"D", b"P\0")
    wires.gate.client_data(parse(b"", "dp") + bind(b"", b"") + describe_portal + execute() + SYNC)
    assert wires.asked == [ProxyRequest(Noisy("dp"), sql="dp")], "the answer itself, not a separate description"
    wires.gate.proxy_answered(ANSWER)
    assert wires.types(wires.client) == [b"1", b"2", b"T", b"D", b"D", b"D", b"C", b"N", b"Z"]
    assert len(wires.asked) == 1


def test_portals_end_with_the_implicit_transaction() -> None:
    wires = Wires()
    wires.gate.client_data(parse(b"", "dp") + bind(b"", b"") + execute() + SYNC)
    wires.gate.proxy_answered(ANSWER)
    assert wires.types(wires.client) == [b"1", b"2", b"D", b"D", b"D", b"C", b"N", b"Z"]
    wires.gate.client_data(execute() + SYNC)  # the Sync outside a transaction block ended the portal
    messages = MessageBuffer().feed(bytes(wires.client))
    assert [t for t, _ in messages] == [b"E", b"Z"] and pg.parse_fields(messages[0][1])["C"] == "34000"
    assert len(wires.asked) == 1
