"""Where deleted jobs sat in the list order ("list anchors"): a client paging `GET /v1/videos` with a job
deleted (or expired) since its previous page as `after` goes on after it, also across a restart.

An anchor is a deleted job's (created_at, seq), the list's sort key. JobStore (jobs.py) records it in memory
(the last GONE_CURSORS) and in the `list_anchors` table (job_schema.py), in the transaction that deletes the
job's row (`write`); `lookup` reads memory first, then the table. Each such transaction also prunes the
anchors older than ANCHOR_KEEP_S, so the table holds about a day of deletions, never more. A deletion whose
anchor the disk refuses (full) still goes through (jobs.py): that anchor is then in memory only, as every
anchor was before the table, and a restart forgets it (the client's next page is empty).
"""

from __future__ import annotations

import sqlite3
from collections import OrderedDict
from collections.abc import Sequence

GONE_CURSORS = 10_000
"""Deleted jobs whose anchor is also kept in memory (the newest; the table keeps the others of the day)."""
ANCHOR_KEEP_S = 24 * 3600.0
"""How long a deleted job's anchor is kept in the table: far longer than a client takes between two pages,
a restart between them included."""


class ListAnchors:
    """job id -> (created_at, seq) of deleted jobs: the newest in memory, those of the last day in the table."""

    def __init__(self) -> None:
        self._memory: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def remember(self, job_id: str, created_at: float, seq: int) -> None:
        """Keep the anchor of a job whose row is gone (in memory: the table's row, if any, is `write`'s)."""
        self._memory[job_id] = (created_at, seq)
        if len(self._memory) > GONE_CURSORS:
            self._memory.popitem(last=False)

    @staticmethod
    def write(db: sqlite3.Connection, rows: Sequence[sqlite3.Row], deleted_at: float) -> None:
        """Inside the caller's transaction (the one deleting `rows`, which carry id, created_at and seq):
        their anchors stored, and those older than ANCHOR_KEEP_S at `deleted_at` pruned."""
        db.executemany(
            "INSERT OR REPLACE INTO list_anchors (id, created_at, seq, deleted_at) VALUES (?, ?, ?, ?)",
            [(r["id"], r["created_at"], r["seq"], deleted_at) for r in rows],
        )
        db.execute("DELETE FROM list_anchors WHERE deleted_at < ?", (deleted_at - ANCHOR_KEEP_S,))

    def lookup(self, reader: sqlite3.Connection, job_id: str) -> tuple[float, int] | None:
        """The anchor of a deleted job (memory first, then the table), None for an id never deleted here (or
        deleted more than ANCHOR_KEEP_S ago)."""
        if (anchor := self._memory.get(job_id)) is not None:
            return anchor
        row = reader.execute("SELECT created_at, seq FROM list_anchors WHERE id=?", (job_id,)).fetchone()
        return None if row is None else (row[0], row[1])
