"""The last job body each API key was served: status polls answered while the database is down.

Every status read (`GET /v1/fine_tuning/jobs/{id}`) remembers the body it answered, under the
key's digest and the job id. When the database cannot be reached, the same key polling the same
job gets that body again, marked stale: `Age` (seconds since it was read from the database) and
`Loraq-Stale: database-unavailable`. Any other request needing the database answers 503.

Why this is sound:
- It tells nobody anything new: a body goes back only to the key it was served to, and is what
  that key already received. A key revoked meanwhile is refused again once the database answers.
- It never states what is false: it is the job as it was, with its age. A job that had ended
  (succeeded, failed, cancelled) cannot change, so its stale body is still its current one; a
  running or queued job's body says how old its progress is. A client polling until the job ends
  keeps polling, as it would through a 503.
- It is bounded: `LAST_SERVED_SIZE` bodies of a few KiB per API process, least recently read
  first out; a poll that reaches an API process which never served it gets the 503.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from fastapi.responses import Response

LAST_SERVED_SIZE = 4096
STALE_HEADER = "Loraq-Stale"


class LastServed:
    """(key digest, job id) -> (body, monotonic time it was read). Used on the event loop only."""

    def __init__(self, size: int = LAST_SERVED_SIZE) -> None:
        self.size = size
        self._bodies: OrderedDict[tuple[str, str], tuple[bytes, float]] = OrderedDict()

    def remember(self, digest: str, job_id: str, body: bytes) -> None:
        key = (digest, job_id)
        self._bodies[key] = (body, time.monotonic())
        self._bodies.move_to_end(key)
        if len(self._bodies) > self.size:
            self._bodies.popitem(last=False)

    def stale_response(self, digest: str, job_id: str) -> Response | None:
        """The body last served to this key for this job, marked stale; None if there is none."""
        found = self._bodies.get((digest, job_id))
        if found is None:
            return None
        body, read_at = found
        headers = {"Age": str(int(time.monotonic() - read_at)), STALE_HEADER: "database-unavailable"}
        return Response(body, media_type="application/json", headers=headers)
