"""Human-readable values for the CLI's tables: durations, relative times, short unique ids.

Pure functions (no I/O), so the tables' contents are tested without a terminal.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

# An id shortened below this many characters after its prefix reads as a typo, not an id.
MIN_ID_CHARS = 6


def duration(seconds: float | None) -> str:
    """3m 22s, 1h 05m, 2d 3h; '-' when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "-"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m {s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h {m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d {h}h"


def ago(unix: float | None, now: float | None = None) -> str:
    """'just now', '2 min ago', '3 h ago', '4 days ago'; '-' when unknown."""
    if not unix:
        return "-"
    delta = (time.time() if now is None else now) - unix
    if delta < 0:
        return "in the future"
    if delta < 10:
        return "just now"
    if delta < 60:
        return f"{int(delta)} s ago"
    if delta < 3600:
        return f"{int(delta // 60)} min ago"
    if delta < 86400:
        return f"{int(delta // 3600)} h ago"
    days = int(delta // 86400)
    return f"{days} day{'s' if days > 1 else ''} ago"


def job_duration(job: dict[str, object], now: float | None = None) -> str:
    """Wall time from start to finish (to now while it runs); '-' before it starts."""
    started = job.get("started_at")
    if not isinstance(started, int | float):
        return "-"
    finished = job.get("finished_at")
    end = finished if isinstance(finished, int | float) else (time.time() if now is None else now)
    return duration(end - started)


def size(n: int | None) -> str:
    """1.5 MiB; '-' when unknown."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def unique_prefixes(ids: Sequence[str]) -> dict[str, str]:
    """Each id → its shortest prefix (at least MIN_ID_CHARS after 'ftjob-') that no other id shares.

    The CLI accepts such a prefix wherever it takes an id, so a shortened table stays usable."""
    out: dict[str, str] = {}
    for i in ids:
        head = i.find("-") + 1  # keep the type prefix: "ftjob-", "file-"
        n = head + MIN_ID_CHARS
        while n < len(i) and any(o != i and o.startswith(i[:n]) for o in ids):
            n += 1
        out[i] = i[:n]
    return out
