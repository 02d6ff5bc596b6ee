#!/usr/bin/env python3
"""The gate's own work per execution of a prepared statement (Bind, Execute, Sync and their answers), in process.

The gate is sans-I/O: this drives a real ``Gate`` of the tree in the current directory with the real ``decide()``
(tests/test_rewrite.py's policy, its suppress role; decisions cached by text as the session caches them), a
statement prepared once, then ``PASSES`` executions, each answered by a fake service connection (BindComplete,
a row, CommandComplete, ReadyForQuery). Loops as in run.py: ``plain`` (a parameter decided at Parse, two
values alternating), ``like1`` (a pattern decided at Bind, one value), ``like2`` (two patterns alternating).

Instruction counts, for valgrind (the same for the same code whatever else runs)::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python3 benchmarks/bind_time/gate_loop.py plain 2000

((PASSES 3000 − PASSES 1000) / 2000: instructions per execution.) Without valgrind it prints the mean time.
"""

from __future__ import annotations

import struct
import sys
import time
from pathlib import Path

sys.path[:0] = [".", str(Path("tests"))]

from test_rewrite import POLICY, SUPPRESS

from anonproxy.proxy.gate import Gate
from anonproxy.route.decide import decide
from anonproxy.route.decision import Decision
from anonproxy.wire import protocol as pg
from anonproxy.wire.framing import MessageBuffer

LOOPS = {
    "plain": ("select education, count(*) from adult where age > $1 group by 1", [b"30", b"40"]),
    "like1": ("select count(*) from adult where occupation ilike $1", [b"%sales%"]),
    "like2": ("select count(*) from adult where occupation ilike $1", [b"%sales%", b"%tech%"]),
}
_ANSWERS = {b"P": [(b"1", b"")], b"B": [(b"2", b"")], b"C": [(b"3", b"")],
            b"E": [(b"D", b"\0\1\0\0\0\0011"), (b"C", b"SELECT 1\0")], b"S": [(b"Z", b"I")], b"Q": [(b"Z", b"I")]}


def main() -> None:
    loop, passes = sys.argv[1], int(sys.argv[2])
    sql, values = LOOPS[loop]
    decisions: dict[str, Decision] = {}

    def decided(text: str) -> Decision:
        if text not in decisions:
            decisions[text] = decide(text, SUPPRESS, POLICY)
        return decisions[text]

    sent = bytearray()
    gate = Gate(decide=decided, settings=lambda: {"k": "10"}, write_client=lambda data: None,
                send_upstream=lambda data: None, send_service=sent.extend, ask_proxy=lambda request: None)

    def answer() -> None:
        while sent:
            messages = list(MessageBuffer().feed(bytes(sent)))
            sent.clear()
            for type_, _ in messages:
                for reply in _ANSWERS.get(type_, []):
                    gate.service_message(*reply)

    gate.client_data(pg.message(b"P", b"s\0" + sql.encode() + b"\0" + struct.pack("!h", 0)) + pg.message(b"S"))
    answer()
    executions = [pg.message(b"B", b"\0s\0" + struct.pack("!hhi", 0, 1, len(value)) + value + struct.pack("!h", 0))
                  + pg.message(b"E", b"\0" + struct.pack("!i", 0)) + pg.message(b"S") for value in values]
    start = time.perf_counter()
    for i in range(passes):
        gate.client_data(executions[i % len(executions)])
        answer()
    print(f"{loop}: {(time.perf_counter() - start) / passes * 1e6:.1f} µs per execution")


if __name__ == "__main__":
    main()
