"""A least-recently-used cache bounded by the bytes of what it holds, not by its number of entries.

Statements are keys: a count bound would let a few long statements (each up to
the proxy's ``max_statement_size``, with rewrites and plans longer still) take
gigabytes. The caller says what an entry weighs (its texts' lengths, roughly).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

ENTRY_OVERHEAD = 200  # bytes of bookkeeping per entry: the dict slot, the tuple key, the value object


class BoundedCache(Generic[K, V]):
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, weight: int) -> None:
        """Keep ``value`` unless it alone outweighs the bound; evict the least recently used to make room."""
        weight += ENTRY_OVERHEAD
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        if weight > self.max_bytes:
            return
        while self._entries and self.bytes + weight > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted
        self._entries[key] = (value, weight)
        self.bytes += weight
