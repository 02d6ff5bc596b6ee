"""What one gated session may keep in the proxy's memory: its cursors' rows, its prepared statements.

The limits come from the proxy's settings (config.py, docs/proxy.md); past
one, the statement that would go over is refused with SQLSTATE 54000
(program_limit_exceeded), a message naming the limit and a hint naming the
setting, and nothing of it is kept: the session goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ProxyConfig


@dataclass(frozen=True)
class MemoryLimits:
    cursor_size: int = ProxyConfig.max_cursor_size  # bytes of rows one cursor the proxy holds keeps
    session_cursor_size: int = ProxyConfig.max_session_cursor_size  # bytes of rows of all of a session's cursors
    cursors: int = ProxyConfig.max_session_cursors  # cursors the proxy holds for one session
    statements: int = ProxyConfig.max_prepared_statements  # named prepared statements one session keeps
    statement_size: int = ProxyConfig.max_prepared_size  # bytes of their texts (and rewrites)

    @classmethod
    def of(cls, config: ProxyConfig) -> MemoryLimits:
        return cls(config.max_cursor_size, config.max_session_cursor_size, config.max_session_cursors,
                   config.max_prepared_statements, config.max_prepared_size)


DEFAULT_LIMITS = MemoryLimits()


def size_text(size: int) -> str:
    """Bytes as an error message says them: exact below 1 kB, else kB or MB with one decimal at most, rounded up
    (a size just over a limit never reads as the limit)."""
    if size < 1024:
        return f"{size} bytes"
    unit, factor = ("MB", 1 << 20) if size >= 1 << 20 else ("kB", 1 << 10)
    tenths = -(-size * 10 // factor)
    return f"{tenths // 10}{f'.{tenths % 10}' if tenths % 10 else ''} {unit}"
