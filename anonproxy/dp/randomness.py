"""Uniform random integers for the noise samplers, from the operating system's CSPRNG, read in blocks.

:func:`secrets.randbelow` reads ``os.urandom`` once per call (a system call for a few bytes); a dp answer's draws
make hundreds of calls. :func:`randbelow` serves the same bytes from a block of ``os.urandom`` read once per
:data:`BLOCK` bytes: every value is still made of bytes straight from the kernel's CSPRNG, each byte used once,
with the same rejection method as :class:`random.SystemRandom` (the top k bits of ⌈k/8⌉ bytes, k the bit length
of n, drawn again while ≥ n), so the distribution is exactly uniform on {0..n−1}. No generator of our own is
seeded from them.

Bytes not used yet must never be used by two processes: a forked child starts with an empty block (the parent's
unread bytes stay the parent's), and threads take bytes under a lock.
"""

from __future__ import annotations

import os
import threading

__all__ = ["BLOCK", "randbelow"]

BLOCK = 4096  # bytes of os.urandom read at once: the draws of a few dp answers (each takes a few hundred)


class _Block:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data = b""
        self.at = 0

    def forget(self) -> None:
        """In a forked child: drop the unread bytes (they are the parent's), and a lock another thread of the parent
        may have held at the fork."""
        self.lock = threading.Lock()
        self.data, self.at = b"", 0


_BLOCK = _Block()
os.register_at_fork(after_in_child=_BLOCK.forget)


def randbelow(n: int) -> int:
    """A uniform random integer in [0, n), n ≥ 1, as :func:`secrets.randbelow`."""
    if n <= 0:
        raise ValueError("randbelow needs a positive upper bound")
    if n == 1:  # the one value: no byte to read (the samplers' Bernoulli trials ask for it at every first step)
        return 0
    bits = n.bit_length()
    size = (bits + 7) // 8
    shift = size * 8 - bits
    block = _BLOCK
    with block.lock:
        while True:
            end = block.at + size
            if end > len(block.data):
                block.data, block.at, end = os.urandom(max(BLOCK, size)), 0, size
            value = int.from_bytes(block.data[block.at:end], "big") >> shift
            block.at = end
            if value < n:
                return value
