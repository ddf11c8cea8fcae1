"""The web dashboard in a real browser: headless Chromium, driven through its WebDriver
(chromedriver) by selenium, against a real 3-member cluster. The page loads, turns away a wrong
password, logs in, shows a queue this test declared and its depth as it changes, every member's
lag and digest agreement, the publish and deliver rates of a queue while this test publishes to
it and fetches from it (and none once it stops), and shows a member this test killed as gone
while it goes on showing the others."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pytest
from brokerclients import connect

from cpgbroker.dev.brokers import BrokerSet
from prereq import unavailable

pytestmark = pytest.mark.integration

# How long the page may take to show a change: it polls every 2 s, a member's departure
# reaches the others within corosync's token timeout (1 s in the test cluster).
SHOW_TIMEOUT = 20.0
# Digest checkpoints this often (events; the default is 10,000), so that the members' digests
# are compared within the test.
CHECKPOINT_EVERY = 100


def browser_problem() -> str | None:
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        return "Chromium or its WebDriver is missing (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError as e:
        return f"selenium is not installed (pip install -e '.[test]'): {e}"
    return None


@pytest.fixture
def browser() -> Iterator[Any]:
    problem = browser_problem()
    if problem:
        unavailable(f"the dashboard's browser test cannot run here: {problem}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(shutil.which("chromium"))
    # --no-sandbox: Chromium's sandbox refuses to start as root, which these tests run as (the
    # cluster needs network namespaces); the page it loads is our own.
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000"):
        options.add_argument(arg)
    # The console, to fail on the page's script errors.
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver named outright: selenium would otherwise look for one to download.
    driver = webdriver.Chrome(service=Service(str(shutil.which("chromedriver"))), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Any, what: str, check: Callable[[], Any]) -> Any:
    """``check()``'s first truthy value, polled until SHOW_TIMEOUT; on timeout, the failure
    shows what the page says."""
    from selenium.common.exceptions import WebDriverException

    deadline = time.monotonic() + SHOW_TIMEOUT
    while True:
        try:
            got = check()
        except WebDriverException:
            got = None  # an element replaced while read: the page redraws every poll
        if got:
            return got
        if time.monotonic() > deadline:
            text = driver.find_element("tag name", "body").text
            pytest.fail(f"the page did not show {what} in {SHOW_TIMEOUT:.0f} s; it shows:\n{text}")
        time.sleep(0.2)


def member_states(driver: Any) -> dict[str, str]:
    rows = driver.find_elements("css selector", "#members tbody tr")
    return {r.get_attribute("data-node"): r.get_attribute("data-state") for r in rows}


def queue_cells(driver: Any, name: str) -> list[str] | None:
    for row in driver.find_elements("css selector", "#queues tbody tr"):
        if row.get_attribute("data-queue") == name:
            return [td.text for td in row.find_elements("tag name", "td")]
    return None


def ready(driver: Any, queue: str) -> str | None:
    cells = queue_cells(driver, queue)
    return None if cells is None else cells[3]


def queue_rates(driver: Any, name: str) -> tuple[float, float] | None:
    """The queue's publish and deliver rates as the page shows them ("2.5/s"); None while it
    shows none."""
    for row in driver.find_elements("css selector", "#queues tbody tr"):
        if row.get_attribute("data-queue") == name:
            publish = row.find_element("css selector", "td.publish").text
            deliver = row.find_element("css selector", "td.deliver").text
            if not (publish.endswith("/s") and deliver.endswith("/s")):
                return None
            return float(publish.removesuffix("/s")), float(deliver.removesuffix("/s"))
    return None


def member_progress(driver: Any) -> dict[str, tuple[str | None, str | None]]:
    """Per node: how many events it is behind the answering member (None: not shown) and
    whether its digest agreed at the last checkpoint ("yes", "no", "unknown")."""
    out = {}
    for row in driver.find_elements("css selector", "#members tbody tr"):
        behind = row.find_elements("css selector", "td.behind")
        digest = row.find_element("css selector", "td.digest")
        out[row.get_attribute("data-node")] = (
            behind[0].get_attribute("data-behind") if behind else None,
            digest.get_attribute("data-agreed"),
        )
    return out


def test_the_dashboard_shows_queues_and_a_killed_member(
    broker_set: Callable[..., BrokerSet], browser: Any
) -> None:
    bs = broker_set(checkpoint_every=CHECKPOINT_EVERY)
    node = {n: f"cpgbroker@127.0.0.1:{bs.ports[n][0]}" for n in (1, 2, 3)}
    conn = connect(bs, 1)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("dash.orders", durable=True)
    for i in range(3):
        ch.basic_publish("", "dash.orders", b"m%d" % i, pika.BasicProperties(delivery_mode=2))

    # Without the final "/", as people type it: redirected to the page.
    browser.get(f"http://127.0.0.1:{bs.ports[1][1]}/dashboard")
    assert browser.current_url.endswith("/dashboard/")
    user = browser.find_element("id", "username")
    password = browser.find_element("id", "password")
    user.send_keys("guest")
    password.send_keys("wrong")
    browser.find_element("id", "login-button").click()
    wait_for(browser, "the refused login", lambda: browser.find_element("id", "login-error").text)
    assert not browser.find_element("id", "main").is_displayed()
    password.clear()
    password.send_keys("guest")
    browser.find_element("id", "login-button").click()

    # The queue, its depth, the members and the client's connection on member 1.
    cells = wait_for(browser, "the queue", lambda: queue_cells(browser, "dash.orders"))
    assert cells[:5] == ["/", "dash.orders", "classic", "3", "0"], cells
    assert member_states(browser) == {node[n]: "ready" for n in (1, 2, 3)}
    groups = browser.find_elements("css selector", "#connections tr.group")
    assert [g.get_attribute("data-node") for g in groups] == [node[1]]

    # Every member's lag behind member 1 (which answers: none) and its digest's agreement, once
    # a checkpoint has compared them.
    def all_agreed() -> dict[str, tuple[str | None, str | None]] | None:
        progress = member_progress(browser)
        return progress if all(a == "yes" for _, a in progress.values()) else None

    progress = wait_for(browser, "every member's digest as agreed", all_agreed)
    assert progress[node[1]] == ("0", "yes"), progress
    for n in (2, 3):
        behind = progress[node[n]][0]
        assert behind is not None and int(behind) >= 0, progress

    # Rates: a few messages a second published to a queue and fetched from it, until the page
    # shows both rates (it needs two of its polls, 2 s apart).
    ch.queue_declare("dash.rates")

    def rates_shown() -> tuple[float, float] | None:
        ch.basic_publish("", "dash.rates", b"tick")
        ch.basic_get("dash.rates", auto_ack=True)
        rates = queue_rates(browser, "dash.rates")
        return rates if rates is not None and min(rates) > 0 else None

    publish, deliver = wait_for(browser, "the publish and deliver rates of dash.rates", rates_shown)
    # A rate, not a count: this test publishes at most ~5 messages a second.
    assert 0 < publish < 10 and 0 < deliver < 10, (publish, deliver)

    bs.kill(3)  # SIGKILL: a crashed member, as the others see it
    wait_for(
        browser,
        "member 3 as gone",
        lambda: member_states(browser) == {node[1]: "ready", node[2]: "ready", node[3]: "gone"},
    )
    row = browser.find_element("css selector", f'#members tr[data-node="{node[3]}"]')
    assert "left at" in row.text
    assert member_progress(browser)[node[3]] == (None, "unknown")
    # The page goes on following the cluster after the loss.
    ch.basic_publish("", "dash.orders", b"after", pika.BasicProperties(delivery_mode=2))
    wait_for(browser, "the new depth", lambda: ready(browser, "dash.orders") == "4")
    assert not browser.find_element("id", "banner").is_displayed()
    # Nothing published to dash.rates since: its rates fall back to none.
    wait_for(browser, "dash.rates idle", lambda: queue_rates(browser, "dash.rates") == (0.0, 0.0))

    errors = [e for e in browser.get_log("browser") if e.get("source") == "javascript"]
    assert errors == [], errors
    conn.close()
