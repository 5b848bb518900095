"""The panel app in a real browser: served on 127.0.0.1, driven by Debian's chromium through
Playwright. A slider moves and the displayed estimate changes; the live timeline of a short
real run (conftest's GRPO) opens and follows a further iteration. Screenshots are kept in
runs/test-artifacts/browser/."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from widgets import LiveTimeline, MetricsDashboard

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "runs" / "test-artifacts" / "browser"

playwright = pytest.importorskip("playwright.sync_api", reason="pip install the dev extras (playwright)")
if not Path(CHROMIUM).exists():
    pytest.skip(
        "Debian chromium is not installed (apt-get install chromium; the Makefile does it)", allow_module_level=True
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app(run):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workbench",
            "app",
            "--run",
            str(run["recorder"].run_dir),
            "--port",
            str(port),
            "--refresh-ms",
            "300",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert server.poll() is None, server.stdout.read().decode()
            time.sleep(0.5)
    yield f"http://127.0.0.1:{port}"
    os.killpg(server.pid, signal.SIGTERM)  # the server's own process group (start_new_session)
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def page(app):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(app)
        yield page
        browser.close()


def test_moving_a_slider_changes_the_estimate(page):
    expect = playwright.expect
    estimate = page.get_by_text("estimated iteration").first
    expect(estimate).to_be_visible()
    before = estimate.text_content()
    assert "on 4 x this machine" in before
    page.locator(".noUi-handle").first.focus()  # the first slider: machines
    page.keyboard.press("ArrowRight")
    expect(page.get_by_text("on 8 x this machine").first).to_be_visible()
    after = page.get_by_text("estimated iteration").first.text_content()
    assert after != before
    page.screenshot(path=str(ARTIFACTS / "explorer.png"), full_page=True)


def test_the_live_timeline_of_a_short_run_follows_it(page, run):
    expect = playwright.expect
    page.get_by_text("Live timeline").first.click()
    trace = run["recorder"].trace_path
    expect(page.get_by_text(LiveTimeline(trace).summary()).first).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "timeline.png"), full_page=True)
    # One more iteration while the page is open: the app picks up the new spans by itself.
    run["grpo"].fit([run["prompts"]], iterations=1, log=None, callbacks=[run["recorder"]])
    now = LiveTimeline(trace).summary()
    expect(page.get_by_text(now).first).to_be_visible()
    page.wait_for_timeout(1500)  # the figure follows the text
    page.screenshot(path=str(ARTIFACTS / "timeline_after.png"), full_page=True)
    page.get_by_text("Metrics").first.click()
    metrics = MetricsDashboard.from_jsonl(run["recorder"].metrics_path)
    assert metrics.history[-1]["iteration"] == run["grpo"].iteration
    expect(page.get_by_text(metrics.summary()).first).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "metrics.png"), full_page=True)
