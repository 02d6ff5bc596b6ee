"""anonproxy.dp.randomness: the samplers' uniform integers, from os.urandom read in blocks (no database).

Statistical checks are chi-square tests at a false-alarm rate of 1e-4, confirmed on a fresh sample before they fail
(as in tests/test_mechanisms.py). The block's rules: every byte used once, whatever the threads, and a forked child
never draws the parent's unread bytes.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

import pytest

from anonproxy.dp import mechanisms, randomness

# Chi-square critical values at 1e-4 by degrees of freedom (tables; scipy.stats.chi2.isf(1e-4, df)).
CRITICAL = {2: 18.4207, 4: 23.5127, 5: 25.7448}
DRAWS = 60_000


def _chi_square(n: int) -> float:
    counts = Counter(randomness.randbelow(n) for _ in range(DRAWS))
    assert set(counts) <= set(range(n))
    expected = DRAWS / n
    return sum((counts.get(value, 0) - expected) ** 2 / expected for value in range(n))


@pytest.mark.parametrize("n", [3, 5, 6])  # 3, 5, 6: values ≥ n are drawn and rejected
def test_uniform_below_n(n: int) -> None:
    if _chi_square(n) > CRITICAL[n - 1]:
        assert _chi_square(n) <= CRITICAL[n - 1]


def test_edges() -> None:
    assert {randomness.randbelow(1) for _ in range(100)} == {0}
    assert {randomness.randbelow(2) for _ in range(1000)} == {0, 1}
    huge = 1 << (8 * randomness.BLOCK * 2 + 3)  # more bytes than a block
    assert 0 <= randomness.randbelow(huge) < huge
    for bad in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            randomness.randbelow(bad)


def test_the_samplers_draw_from_it() -> None:
    assert mechanisms._randbelow is randomness.randbelow


def test_threads_never_share_bytes() -> None:
    """Four threads drawing 64-bit values at once: a byte served twice would repeat values (2⁻⁶⁴ by chance)."""
    drawn: list[list[int]] = [[] for _ in range(4)]

    def draw(into: list[int]) -> None:
        into.extend(randomness.randbelow(1 << 64) for _ in range(20_000))

    threads = [threading.Thread(target=draw, args=(into,)) for into in drawn]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    values = [value for into in drawn for value in into]
    assert len(set(values)) == len(values)


def test_a_forked_child_does_not_draw_the_parents_bytes() -> None:
    randomness.randbelow(1 << 64)  # the parent's block now holds unread bytes
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next values, then leave without pytest's clean-up
        try:
            os.write(writing, b"".join(randomness.randbelow(1 << 64).to_bytes(8, "big") for _ in range(8)))
        finally:
            os._exit(0)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    child = {int.from_bytes(data[at:at + 8], "big") for at in range(0, len(data), 8)}
    parent = {randomness.randbelow(1 << 64) for _ in range(8)}
    assert len(child) == 8
    assert not child & parent
