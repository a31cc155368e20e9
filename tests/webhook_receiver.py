"""A webhook receiver as a user would write one, run as its own process by the webhook tests:

    python -m tests.webhook_receiver --port P --secret whsec_… --dir D [--hang-after-processing]
                                     [--status CODE] [--tls CERT KEY] [--endless-body]

Each POST is checked with OpenAI's client (`client.webhooks.unwrap`: Standard Webhooks'
signature and timestamp, then the event parsed as OpenAI's type), logged to `D/received.jsonl`,
and processed at most once per `webhook-id`: a new id is appended to `D/processed.jsonl`
(fsynced) before the answer, an id already there is acknowledged without processing it again, so
a delivery repeated after a crash between processing and answering is harmless.

`--hang-after-processing`: after processing its first event, never answer (the test kills the
process mid-delivery). `--status`: answer every request with CODE (after logging it, processing
nothing). A bad signature is answered 400. `--tls`: serve https with this certificate and key.
`--endless-body`: a 200's body never ends (a sender must not read it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import ssl
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    from openai import InvalidWebhookSignatureError, OpenAI

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--secret", required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--hang-after-processing", action="store_true")
    parser.add_argument("--status", type=int, default=None)
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"), default=None)
    parser.add_argument("--endless-body", action="store_true")
    args = parser.parse_args()
    client = OpenAI(api_key="unused", webhook_secret=args.secret)
    received, processed = args.dir / "received.jsonl", args.dir / "processed.jsonl"
    done = {r["webhook_id"] for r in read_jsonl(processed)}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            headers = {k.lower(): v for k, v in self.headers.items()}
            webhook_id = headers.get("webhook-id", "")
            verified, event_type, job_id = False, "", None
            try:
                event = client.webhooks.unwrap(body, headers)
                verified, event_type, job_id = True, str(event.type), getattr(event.data, "id", None)
            except (InvalidWebhookSignatureError, ValueError) as e:
                event_type = repr(e)
            seen = webhook_id in done
            _append(
                received,
                {
                    "webhook_id": webhook_id,
                    "verified": verified,
                    "type": event_type,
                    "job_id": job_id,
                    "body": body.decode(),
                    "timestamp": headers.get("webhook-timestamp"),
                    "duplicate": seen,
                    "host": headers.get("host"),
                },
            )
            if args.status is not None:
                return self._answer(args.status)
            if not verified:
                return self._answer(400)
            if not seen:
                _append(processed, {"webhook_id": webhook_id, "type": event_type, "job_id": job_id})
                done.add(webhook_id)
                if args.hang_after_processing:
                    time.sleep(3600)  # killed here, before answering
            self._answer(200)

        def _answer(self, status: int) -> None:
            self.send_response(status)
            if args.endless_body and status == 200:
                self.end_headers()  # no length: the body ends when the connection does
                with contextlib.suppress(OSError):
                    while True:
                        self.wfile.write(b"x" * 65536)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *a: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    if args.tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*args.tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
