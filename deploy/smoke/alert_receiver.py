"""deploy/smoke.sh's webhook receiver for Alertmanager (the standard library only): prints one
JSON line per alert it is sent — ``{"alert_received": name, "status": firing|resolved, ...}`` —
which the smoke test looks for in this container's log. ``GET /healthz`` answers 200."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            doc = json.loads(body)
            alerts = doc["alerts"]
        except (ValueError, KeyError, TypeError):
            self.send_error(400, "expected Alertmanager's webhook JSON")
            return
        for a in alerts:
            labels = a.get("labels", {})
            print(json.dumps({"alert_received": labels.get("alertname"), "status": a.get("status"),
                              "severity": labels.get("severity"), "instance": labels.get("instance"),
                              "receiver": doc.get("receiver"), "starts_at": a.get("startsAt")}), flush=True)
        self.send_response(200)
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:  # the JSON lines above are the log
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("0.0.0.0", 9099), Receiver).serve_forever()
