"""The panel app in a real browser: served on 127.0.0.1, driven by Debian's chromium through
Playwright, on the run of conftest's short real GRPO. A slider moves and the explorer's plot
data changes; a timeline span is hovered (its tooltip read), clicked (the batch inspector
opens) and zoomed; the timeline follows a further iteration; the metrics charts show it.
Screenshots of each view at 1280x800 are kept in runs/test-artifacts/browser/."""

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
VIEWPORT = {"width": 1280, "height": 800}

playwright = pytest.importorskip("playwright.sync_api", reason="pip install the dev extras (playwright)")
if not Path(CHROMIUM).exists():
    pytest.skip(
        "Debian chromium is not installed (apt-get install chromium; the Makefile does it)", allow_module_level=True
    )

# Read the figures' state in the page: Bokeh's own document and views (names set in widgets/).
DATA = "([name, column]) => Array.from(Bokeh.documents[0].get_model_by_name(name).data[column])"
X_RANGE = "(name) => { const r = Bokeh.documents[0].get_model_by_name(name); return [r.start, r.end] }"
# Where on the page span `i` of the timeline is drawn (the middle of its compute part).
SPAN_AT = """(i) => {
  const view = Bokeh.index.query_one(v => v.model.name == 'timeline');
  const d = Bokeh.documents[0].get_model_by_name('timeline_spans').data;
  const box = view.canvas_view.el.getBoundingClientRect();
  return [box.left + view.frame.x_scale.compute((d.fetched[i] + d.end[i]) / 2),
          box.top + view.frame.y_scale.compute(d.lane[i])];
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def screenshot(page, name: str) -> Path:
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))  # the viewport: 1280x800
    print(f"screenshot: {path}")
    return path


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
        page = browser.new_page(viewport=VIEWPORT)
        page.set_default_timeout(60_000)
        # expect() keeps a 5 s default of its own: too short for a first render on a machine 3x
        # slower than ours, or a busy one (it failed so).
        playwright.expect.set_options(timeout=60_000)
        page.goto(app)
        yield page
        browser.close()


def test_moving_a_slider_changes_the_plot_data(page):
    expect = playwright.expect
    expect(page.get_by_text("estimated iteration").first).to_be_visible()
    page.wait_for_function("() => window.Bokeh && Bokeh.documents.length && Bokeh.index.query_one(v => true)")
    before = page.evaluate(DATA, ["explorer_bars", "end"])
    assert before and "on 4 x this machine" in page.get_by_text("estimated iteration").first.text_content()
    page.locator(".noUi-handle").first.focus()  # the first slider: machines
    page.keyboard.press("ArrowRight")
    expect(page.get_by_text("on 8 x this machine").first).to_be_visible()
    page.wait_for_function(f"(b) => ({DATA})(['explorer_bars', 'end']).join() != b.join()", arg=before)
    assert page.evaluate(DATA, ["explorer_bars", "end"]) != before
    page.locator("select").nth(2).select_option("standalone")  # compare with: a second placement
    expect(page.get_by_text("compared with the standalone placement").first).to_be_visible()
    page.wait_for_function("() => Bokeh.documents[0].get_model_by_name('explorer_compare_bars').data.end.length > 0")
    screenshot(page, "explorer")


def test_a_timeline_span_tells_what_it_is_opens_its_batch_and_zooms(page, run):
    expect = playwright.expect
    page.get_by_text("Live timeline").first.click()
    expect(page.get_by_text(LiveTimeline(run["recorder"].trace_path).summary()).first).to_be_visible()
    iterations = page.evaluate(DATA, ["timeline_spans", "iteration"])
    methods = page.evaluate(DATA, ["timeline_spans", "method"])
    ranks = page.evaluate(DATA, ["timeline_spans", "rank"])
    # a span of the latest iteration: the recorder still keeps its batch
    i = max(range(len(methods)), key=lambda k: (iterations[k] if isinstance(iterations[k], int) else -1, methods[k]))
    assert methods[i] == "update_actor"  # the last step of the latest iteration
    x, y = page.evaluate(SPAN_AT, i)
    page.mouse.move(x, y)
    expect(page.get_by_text(f"actor rank {ranks[i]}: {methods[i]}").first).to_be_visible()  # the tooltip
    expect(page.get_by_text("bytes moved").first).to_be_visible()
    expect(page.get_by_text(f"{iterations[i]} (step update_actor)").first).to_be_visible()
    screenshot(page, "timeline_hover")
    page.mouse.click(x, y)
    expect(page.get_by_text(f"batch of actor rank {ranks[i]}: update_actor").first).to_be_visible()
    expect(page.get_by_text("mean adv.").first).to_be_visible()  # the inspector's table
    screenshot(page, "timeline_inspector")
    before = page.evaluate(X_RANGE, "timeline_x")
    page.mouse.move(x, y)
    page.mouse.wheel(0, -600)  # scroll over the plot: zoom in around the pointer
    page.wait_for_function(f"(b) => ({X_RANGE})('timeline_x').join() != b.join()", arg=before)
    start, end = page.evaluate(X_RANGE, "timeline_x")
    assert end - start < before[1] - before[0]
    screenshot(page, "timeline_zoomed")


def test_the_live_timeline_follows_a_further_iteration(page, run):
    expect = playwright.expect
    spans = len(page.evaluate(DATA, ["timeline_spans", "span"]))
    run["grpo"].fit([run["prompts"]], iterations=1, log=None, callbacks=[run["recorder"]])
    expect(page.get_by_text(LiveTimeline(run["recorder"].trace_path).summary()).first).to_be_visible()
    page.wait_for_function(f"() => ({DATA})(['timeline_spans', 'span']).length > {spans}")  # streamed in
    page.get_by_text("Metrics").first.click()
    metrics = MetricsDashboard.from_jsonl(run["recorder"].metrics_path)
    assert metrics.history[-1]["iteration"] == run["grpo"].iteration
    expect(page.get_by_text(metrics.summary()).first).to_be_visible()
    shown = page.evaluate(DATA, ["metrics", "iteration"])
    assert shown == [m["iteration"] for m in metrics.history]
    expect(page.get_by_text("export CSV").first).to_be_visible()
    screenshot(page, "metrics")
