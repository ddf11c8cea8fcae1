"""The web dashboard of the admin endpoint (``GET /dashboard/``): a static page whose script
reads the management API (``/api/...``) with the login the user types, as RabbitMQ's
management UI does.

The files (``runtime/mgmt/static/``: ``index.html``, ``app.js``, ``style.css``) ship with the
package as they are: plain HTML, CSS and JavaScript, no build step and nothing fetched from
elsewhere. They hold no data, so they are served to anyone who asks; everything the page shows
comes from ``/api``, which asks for a broker user's login (HTTP Basic) on every request.

:func:`page` is the whole route: a method and a path in, a response (or None: not ours) out.
"""

from __future__ import annotations

import functools
from importlib import resources

from cpgbroker.runtime.mgmt.http11 import Response

PREFIX = "/dashboard"
# The files there is, and what they are.
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# The page loads only its own files and talks only to this endpoint: a queue or connection
# name a client chose cannot bring in a script even if the page had a bug that put it into the
# document as markup. frame-ancestors: no other site may frame the page under its own buttons.
SECURITY_HEADERS = (
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
)


@functools.cache
def _read(name: str) -> bytes:
    # Read once: the files never change while the member runs.
    return (resources.files("cpgbroker.runtime.mgmt") / "static" / name).read_bytes()


def _text(status: int, text: str, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, text.encode(), "text/plain; charset=utf-8", headers)


def page(method: str, path: str) -> Response | None:
    """The answer to ``method path`` if the path is the dashboard's, else None."""
    if path != PREFIX and not path.startswith(PREFIX + "/"):
        return None
    if method not in ("GET", "HEAD"):
        return _text(405, "the dashboard is read-only\n", (("Allow", "GET, HEAD"),))
    if path == PREFIX:
        # The page's files are named relative to the folder.
        return _text(301, "moved to /dashboard/\n", (("Location", PREFIX + "/"),))
    name = path[len(PREFIX) + 1 :] or "index.html"
    content_type = FILES.get(name)
    if content_type is None:
        return _text(404, "no such file in the dashboard\n")
    return Response(200, _read(name), content_type, SECURITY_HEADERS)
