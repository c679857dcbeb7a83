"""serve.py's page in a real browser: Debian's chromium, headless, driven by Playwright. The test types prompts, sees
text arrive, sees the pool's cells change while they run, and sees model text shown as text, never as HTML. It
replays a pass of the timeline, and sends the page's defaults to a model of a small context."""

import http.client
import json
import shutil
import time
import urllib.parse
import urllib.request

import pytest

from bench.page_screenshot import CHROMIUM_FLAGS
from serving import Served, checkpoint, server, write_checkpoint  # noqa: F401  fixtures

sync_api = pytest.importorskip("playwright.sync_api", reason="the page's tests drive a browser with Playwright: "
                                                             "pip install playwright")
CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no browser: apt-get install chromium (.ci/run does)")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


def opened(browser, url: str, errors: list):
    page = browser.new_page()
    page.on("pageerror", lambda error: errors.append(error))
    page.goto(url)
    return page


@pytest.fixture(scope="module")
def page(browser, server):
    errors = []
    yield opened(browser, server.url, errors)
    assert not errors, errors


PROMPT = "ROMEO: Is the day so young? JULIET: It is, it is: "  # two full blocks of 16 and more


def wait_until(page, expression: str, seconds: float = 30) -> None:
    """Poll the page (its Content-Security-Policy forbids the eval that Playwright's wait_for_function uses)."""
    deadline = time.monotonic() + seconds
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not within {seconds} s: {expression}"
        time.sleep(0.05)


def owners(page) -> list[str]:
    return page.eval_on_selector_all("#pool .cell", "cells => cells.map(c => c.dataset.owner)")


def test_two_prompts_stream_their_text_while_the_pool_shows_their_blocks(page):
    wait_until(page, "document.querySelectorAll('#pool .cell').length > 0")
    assert not any(owners(page))
    page.fill("#prompt", PROMPT)
    page.fill("#temperature", "1")
    page.fill("#maxtokens", "200")
    page.fill("#copies", "2")
    page.click("#send")
    seen, counts, deadline = set(), set(), time.monotonic() + 30
    while time.monotonic() < deadline and (len(seen) < 2 or "2" not in counts):
        seen |= {owner for owner in owners(page) if owner}  # each running request colours the cells it holds
        counts |= set(page.eval_on_selector_all("#pool .cell", "cells => cells.map(c => c.textContent)"))
        time.sleep(0.05)
    assert len(seen) == 2 and "2" in counts, (seen, counts)  # the prompt's full blocks, read by both
    wait_until(page, "[...document.querySelectorAll('.card pre span:last-child')]"
                     ".every(s => s.textContent.length == 200)", 60)
    assert page.locator(".card").count() == 2
    wait_until(page, "[...document.querySelectorAll('#pool .cell')].every(c => !c.dataset.owner)")
    assert page.locator("#jobs tr[data-state=done]", has_text="done (length)").count() >= 2


def test_prompts_and_model_text_are_shown_as_text(page):
    page.fill("#prompt", "<img src=x onerror=document.title='owned'><b>bold</b>")
    page.fill("#temperature", "0")
    page.fill("#maxtokens", "5")
    page.fill("#copies", "1")
    page.click("#send")
    wait_until(page, "document.querySelector('.card .meta').textContent.includes('done')")
    card = page.locator(".card").first
    assert card.locator("img, b").count() == 0
    assert card.locator(".prompt").inner_text().startswith("<img src=x")
    assert page.locator("#jobs img, #jobs b").count() == 0 and page.title() != "owned"


def test_a_request_from_another_client_shows_on_the_page(page, server):
    host = urllib.parse.urlsplit(server.url)
    connection = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
    connection.request("POST", "/v1/completions", json.dumps({"prompt": "from elsewhere", "max_tokens": 240,
                                                              "stream": True}), {"Content-Type": "application/json"})
    first = connection.getresponse().readline()
    job = json.loads(first[6:])["id"] + "-0"
    wait_until(page, f"document.querySelector('#jobs tr[data-id=\"{job}\"]') !== null")
    row = page.locator(f'#jobs tr[data-id="{job}"]')
    assert "from elsewhere" in row.inner_text()
    connection.close()


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.load(answer)


def test_the_slider_replays_a_pass_with_the_blocks_it_had(page, server):
    page.fill("#temperature", "0")
    page.fill("#maxtokens", "30")
    page.fill("#workload", "3")
    page.click("#sendworkload")  # three prompts that share a preamble of six full blocks
    wait_until(page, "[...document.querySelectorAll('.card .meta')].slice(0, 3)"
                     ".every(m => m.textContent.includes('done (length)'))", 60)
    wait_until(page, "[...document.querySelectorAll('#pool .cell')].every(c => !c.dataset.owner)")
    workload, first = page.get_attribute(".card", "data-id")[:-2], int(page.get_attribute("#scrubber", "min"))
    moments = [m for m in get(server.url + "/timeline")["moments"]
               if m["seq"] >= first and any(r["id"].startswith(workload) for r in m["requests"])]
    busiest = max(moments, key=lambda m: m["used"])
    assert busiest["used"] > 0 and busiest["shared"] > 0
    page.evaluate("seq => { const s = document.getElementById('scrubber'); s.value = seq; "
                  "s.dispatchEvent(new Event('input')); }", busiest["seq"])
    time.sleep(0.3)  # the page refreshes meanwhile: the replayed pass stays
    cells = page.eval_on_selector_all("#pool .cell", "cells => cells.map(c => [c.dataset.owner || null, "
                                                     "Number(c.dataset.refs), c.title])")
    assert sum(1 for _, refs, _ in cells if refs) == busiest["used"]
    assert [[owner, refs] for owner, refs, _ in cells] == [[owner, refs] for owner, refs, _ in busiest["blocks"]]
    owner, refs, title = next(cell for cell in cells if cell[1] > 1)
    assert f"owned by {owner}, read by {refs}, cached" in title
    assert f"replaying pass {busiest['seq']}" in page.inner_text("#moment")
    rows = {row[0]: row[1:] for row in page.eval_on_selector_all(
        "#jobs tr", "rows => rows.map(r => [r.dataset.id, ...[...r.cells].slice(3, 6).map(c => c.textContent)])")}
    assert [rows[f"{workload}-{i}"] for i in range(3)] == [["104", "0", "0"], ["103", "96", "0"], ["106", "96", "0"]]
    page.evaluate("() => { const s = document.getElementById('scrubber'); s.value = s.max; "
                  "s.dispatchEvent(new Event('input')); }")
    wait_until(page, "document.getElementById('moment').textContent.startsWith('live')")


def test_the_default_max_tokens_fits_a_model_of_a_small_context(browser, tmp_path):
    served, errors = Served(write_checkpoint(tmp_path, block_size=64)), []
    try:
        page = opened(browser, served.url, errors)
        page.click("#send")  # waits for the model's context, which enables it
        wait_until(page, "!/sent|drawing/.test(document.querySelector('.card .meta').textContent)")
        assert "done (length)" in page.inner_text(".card .meta")  # not refused: the text fits the context
        assert page.inner_text("#context") == "64" and page.input_value("#maxtokens") == "32"
        assert len(page.inner_text(".card pre span:last-child")) == 32
        page.close()
    finally:
        served.stop()
    assert not errors, errors
