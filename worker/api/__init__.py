"""The worker's OpenAI-compatible HTTP API (aiohttp).

:func:`create_app` builds the application; :mod:`worker.http_server` runs it inside the
worker process. Handlers (:mod:`worker.api.handlers`) parse, call the scheduler, and
serialise; errors become OpenAI-style JSON in one middleware (:mod:`worker.api.errors`).
"""

from worker.api.app import create_app

__all__ = ["create_app"]
