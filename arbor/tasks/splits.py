"""Train/test split by content hash, shared by every built-in task: a problem text is in "test"
iff the first 8 bytes of its SHA-256, as an integer, are ≡ 0 mod 5 (≈ 20 %). The split depends
on the text alone, so no seed can put one problem in both."""

from __future__ import annotations

import hashlib

TEST_FRACTION_BUCKETS = 5


def split_of(text: str) -> str:
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    return "test" if h % TEST_FRACTION_BUCKETS == 0 else "train"
