"""The web dashboard's route and files (runtime/mgmt/dashboard.py), and the overview field it reads
(the browser test is tests/integration/test_dashboard_browser.py)."""

from __future__ import annotations

import re
from typing import Any

from cpgbroker.runtime.admin.endpoint import AdminRoutes
from cpgbroker.runtime.mgmt import dashboard, views
from cpgbroker.runtime.mgmt.http11 import Request


def test_the_files_are_served_with_their_types_and_no_login() -> None:
    for name, content_type in dashboard.FILES.items():
        page = dashboard.page("GET", f"/dashboard/{name}")
        assert page is not None and page.status == 200, name
        assert page.content_type == content_type and page.body
        headers = dict(page.headers)
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert headers["X-Content-Type-Options"] == "nosniff"
    index = dashboard.page("GET", "/dashboard/")
    assert index is not None and index.body == dashboard.page("GET", "/dashboard/index.html").body
    head = dashboard.page("HEAD", "/dashboard/app.js")
    assert head is not None and head.status == 200


def test_other_paths_and_methods() -> None:
    moved = dashboard.page("GET", "/dashboard")
    assert moved is not None and moved.status == 301
    assert dict(moved.headers)["Location"] == "/dashboard/"
    for path in ("/dashboard/nope.js", "/dashboard/../admin.py", "/dashboard/static/app.js"):
        missing = dashboard.page("GET", path)
        assert missing is not None and missing.status == 404, path
    post = dashboard.page("POST", "/dashboard/")
    assert post is not None and post.status == 405
    for path in ("/", "/status", "/api/overview", "/dashboards", "/metrics"):
        assert dashboard.page("GET", path) is None, path


def test_the_page_names_only_its_own_files() -> None:
    # Nothing from elsewhere (no CDN): every src and href is one of the files served, or the
    # empty data: icon.
    page = dashboard.page("GET", "/dashboard/")
    assert page is not None
    html = page.body.decode()
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert sorted(refs) == ["app.js", "data:,", "style.css"]
    script = dashboard.page("GET", "/dashboard/app.js")
    assert script is not None
    # Client-chosen names go in as text: the script never writes markup.
    assert b"innerHTML" not in script.body and b"insertAdjacentHTML" not in script.body


async def test_the_endpoint_serves_the_page_without_the_secret() -> None:
    routes = AdminRoutes(lambda _digest: {"state": "ready"}, None, "s3cret")

    def get(path: str, auth: str = "") -> Any:
        headers = {"authorization": auth} if auth else {}
        return Request("GET", path, "", headers, b"", "127.0.0.1")

    page = await routes.handle(get("/dashboard/"))
    assert page.status == 200 and page.content_type.startswith("text/html")
    # The status and control side still wants the secret.
    assert (await routes.handle(get("/status"))).status == 401
    assert (await routes.handle(get("/", "Bearer s3cret"))).status == 200


def test_the_overview_shows_the_replication_to_monitors_only() -> None:
    status = {
        "state": "ready",
        "member": 7,
        "url": "amqp://127.0.0.1:5701/",
        "event_seq": 1234,
        "clock_master": 7,
        "members": [
            {
                "member": 7,
                "url": "amqp://127.0.0.1:5701/",
                "status": "ready",
                "applied": 1234,
                "checkpoint_agreed": True,
            },
            {
                "member": 8,
                "url": "amqp://127.0.0.1:5702/",
                "status": "ready",
                "applied": 1000,
                "checkpoint_agreed": False,
            },
        ],
        "lag": {"events_behind": 234, "held_back": 0},
        "checkpoint": {"seq": 1000, "digest": "ab" * 16, "agreed": False, "losers": [8]},
        "error_checks": {"held_at": None, "pending": {}, "decided": []},
        "update": None,
        "updating": [],
        "quorum": {"quorate": True},
        "queues": {"/:q": {"ready": 1, "unacked": 0, "consumers": 0}},
    }
    view = views.cluster_view(status, None, "host1")
    monitor = views.Identity("mon", ("monitoring",))
    shown = views.overview_json(view, monitor)["cpgbroker_cluster"]
    assert shown["event_seq"] == 1234 and shown["lag"] == {"events_behind": 234, "held_back": 0}
    assert shown["checkpoint"]["losers"] == [8] and shown["error_checks"]["held_at"] is None
    # Per member, what the Members table shows: its progress and its digest's agreement.
    assert [(m["member"], m["applied"], m["checkpoint_agreed"]) for m in shown["members"]] == [
        (7, 1234, True),
        (8, 1000, False),
    ]
    assert "queues" not in shown  # the API's own lists have those
    manager = views.Identity("mgr", ("management",))
    assert "cpgbroker_cluster" not in views.overview_json(view, manager)
