"""An argument named ``shared`` crosses to an analysis process once; the process holds it for later calls.

Through ``Analyser`` and its real child process. A list serves as the shared value so that the test can see which
copy a call gets: ``list.append`` changes the child's copy, and ``len`` then tells whether a later call got that
same copy (held) or a fresh one (sent again). The proxy shares only values it never changes (its policy).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from anonproxy.proxy.analysis import HELD, Analyser, AnalysisTimeout


async def _lengths(analyser: Analyser, value: list[int], shared: tuple[Any, ...]) -> tuple[int, int]:
    """The length the child sees after appending to ``value``, then again in a second call."""
    await analyser.run(list.append, value, 1, asker="a", shared=shared)
    first = await analyser.run(len, value, asker="a", shared=shared)
    await analyser.run(list.append, value, 2, asker="a", shared=shared)
    return first, await analyser.run(len, value, asker="a", shared=shared)


def test_a_shared_value_is_held_by_the_process_and_sent_again_after_it_lets_go() -> None:
    async def scenario() -> dict[str, Any]:
        analyser = Analyser(1.0, processes=1)
        analyser.start()
        seen: dict[str, Any] = {}
        value: list[int] = []
        try:
            seen["not shared"] = await _lengths(analyser, value, ())
            seen["shared"] = await _lengths(analyser, value, (value,))
            others = [[n] for n in range(HELD)]  # as many newer shared values as the process holds
            seen["others"] = [await analyser.run(len, other, asker="a", shared=(other,)) for other in others]
            seen["after others"] = await analyser.run(len, value, asker="a", shared=(value,))
            await analyser.run(list.append, value, 3, asker="a", shared=(value,))
            try:
                await analyser.run(time.sleep, 5, asker="a")
            except AnalysisTimeout:
                seen["replaced"] = True
            seen["new process"] = await analyser.run(len, value, asker="a", shared=(value,))
        finally:
            analyser.close()
        seen["here"] = len(value)
        return seen

    seen = asyncio.run(scenario())
    assert seen["not shared"] == (0, 0)  # each call gets its own copy
    assert seen["shared"] == (1, 2)  # one copy, changed by the calls before
    assert seen["others"] == [1] * HELD
    assert seen["after others"] == 0  # let go of (the one used longest ago): sent again
    assert seen["replaced"] and seen["new process"] == 0  # the process that replaced the stopped one held nothing
    assert seen["here"] == 0  # the caller's own value never changed
