"""Seeds derived from a test's parameters, the same in every run (Python's hash() of strings is salted
per process, so seeds made from it drew new inputs each run)."""

import zlib


def stable_seed(*parts) -> int:
    """A non-negative 31-bit seed from the parameters' text."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF
