"""The chat page and the dashboard in a real headless browser (Chromium from the system
packages, driven by Selenium through the system chromedriver), against the session's
real `pagoda serve` (with an API key).

- chat: the page asks for the key, a message streams back, the conversation survives a
  reload (local storage); Stop mid-stream aborts the request on the server (its
  /metrics count the abort and every KV block comes back); reasoning_content is folded
  apart from the answer;
- dashboard: its counters move while a parallel client loads the server;
- no Content-Security-Policy violation on either page.

Screenshots (desktop light, phone dark) go to build/test-artifacts/web-ui/, or to
$PAGODA_WEB_UI_SCREENSHOTS (`PAGODA_WEB_UI_SCREENSHOTS=docs/images` refreshes the ones
docs/web-ui.md shows). Without a browser the tests skip and say how to install one;
.ci/run installs it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from helpers.server_harness import metric_value

INSTALL_HINT = (
    "the browser tests need Chromium, its driver and Selenium: "
    "`apt-get install chromium chromium-driver` and `pip install -e '.[test]'` "
    "(.ci/run installs them)"
)
CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
CHROMEDRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # skipped below
    webdriver = None

pytestmark = pytest.mark.skipif(
    webdriver is None or CHROMIUM is None or CHROMEDRIVER is None, reason=INSTALL_HINT
)
REPO = Path(__file__).resolve().parents[2]
WAIT_S = 90  # generous: a busy 2-core machine generates slowly
POLL_S = 0.05


@pytest.fixture(scope="module")
def shots() -> Path:
    folder = Path(
        os.environ.get("PAGODA_WEB_UI_SCREENSHOTS") or REPO / "build" / "test-artifacts" / "web-ui"
    )
    folder = folder if folder.is_absolute() else REPO / folder
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
        "--force-device-scale-factor=1",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _wait(driver, condition, timeout: float = WAIT_S, message: str = ""):
    return WebDriverWait(driver, timeout, poll_frequency=POLL_S).until(condition, message)


def _el(driver, css: str):
    return driver.find_element(By.CSS_SELECTOR, css)


def _no_csp_violations(driver) -> None:
    refused = [
        e["message"]
        for e in driver.get_log("browser")
        if "Content Security Policy" in e["message"] or "Refused to" in e["message"]
    ]
    assert not refused, refused


def _set_field(driver, field_id: str, value: str) -> None:
    field = _el(driver, "#" + field_id)
    field.clear()
    field.send_keys(value)


def _send(driver, text: str) -> None:
    _el(driver, "#prompt").send_keys(text, Keys.ENTER)


def _last_reply(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]


def _metrics(server) -> str:
    return httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text


def _aborts(server) -> float:
    return metric_value(_metrics(server), "pagoda:request_success_total", 'finished_reason="abort"')


def test_chat_asks_for_the_key_then_streams_a_reply(browser, main_server, shots):
    browser.get(main_server.url + "/")
    # No key stored: /v1/models answered 401, so the page asks for the key.
    _wait(browser, lambda d: _el(d, "#key-dialog").get_attribute("open") is not None)
    browser.save_screenshot(str(shots / "chat-asks-for-key.png"))
    _el(browser, "#key-input").send_keys(main_server.api_key)
    _el(browser, "#key-save").click()
    _wait(browser, lambda d: "context 512" in _el(d, "#model-info").text)
    _set_field(browser, "temperature", "0")
    _set_field(browser, "max-tokens", "48")
    _send(browser, "Write a Python function that returns the sum of two numbers.")
    # Text appears while the reply is still streaming, then the reply completes.
    _wait(
        browser,
        lambda d: (
            _last_reply(d).get_attribute("data-state") == "streaming"
            and _last_reply(d).find_element(By.CSS_SELECTOR, ".content").text.strip()
        ),
        message="no streamed text was seen before the end",
    )
    _wait(browser, lambda d: _last_reply(d).get_attribute("data-state") == "done")
    reply = _last_reply(browser)
    assert reply.find_element(By.CSS_SELECTOR, ".content").text.strip()
    assert "tokens" in reply.find_element(By.CSS_SELECTOR, ".meta").text
    # The conversation lives in local storage and survives a reload.
    stored = json.loads(
        browser.execute_script("return localStorage.getItem('pagoda.conversations')")
    )
    assert [m["role"] for m in stored[0]["messages"]] == ["user", "assistant"]
    browser.refresh()
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".message")) == 2)
    _wait(browser, lambda d: "context 512" in _el(d, "#model-info").text)
    browser.save_screenshot(str(shots / "chat-desktop-light.png"))
    _no_csp_violations(browser)


def test_stop_aborts_the_request_on_the_server(browser, main_server):
    before = _aborts(main_server)
    _el(browser, "#new-chat").click()
    _set_field(browser, "max-tokens", "400")
    _send(browser, "Tell me a long story about a lighthouse keeper and a storm.")
    _wait(browser, lambda d: _last_reply(d).find_element(By.CSS_SELECTOR, ".content").text.strip())
    assert _last_reply(browser).get_attribute("data-state") == "streaming"
    _el(browser, "#stop").click()
    _wait(browser, lambda d: _last_reply(d).get_attribute("data-state") == "stopped")
    assert "stopped" in _last_reply(browser).find_element(By.CSS_SELECTOR, ".meta").text
    deadline = time.monotonic() + WAIT_S
    while _aborts(main_server) < before + 1:  # the server saw the client go and aborted
        assert time.monotonic() < deadline, "the server never counted the abort"
        time.sleep(0.1)  # polling the server's metrics, bounded by the deadline
    audit = httpx.get(
        f"{main_server.url}/debug/kv_audit", headers=main_server.headers, timeout=30
    ).json()
    assert audit["in_use"] == 0
    _no_csp_violations(browser)


def test_reasoning_content_is_folded_apart(browser, main_server):
    """A reply with reasoning_content (no model here sends it: the page's fetch of
    /v1/chat/completions is answered with canned SSE chunks)."""
    browser.get(main_server.url + "/")
    _wait(browser, lambda d: "context" in _el(d, "#model-info").text)
    browser.execute_script("""
      const realFetch = window.fetch;
      const chunks = [{reasoning_content: "The user greets; "}, {reasoning_content: "answer **briefly**."},
                      {content: "Hello **there**!"}];
      window.fetch = (url, opts) => {
        if (!String(url).endsWith("/v1/chat/completions")) return realFetch(url, opts);
        const text = chunks.map((d) => "data: " + JSON.stringify({choices: [{index: 0, delta: d,
          finish_reason: null}]}) + "\\n\\n").join("") + "data: [DONE]\\n\\n";
        return Promise.resolve(new Response(text, {headers: {"Content-Type": "text/event-stream"}}));
      };""")
    _el(browser, "#new-chat").click()
    _send(browser, "Hi")
    _wait(browser, lambda d: _last_reply(d).get_attribute("data-state") == "done")
    reply = _last_reply(browser)
    folded = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert folded.is_displayed() and folded.get_attribute("open") is None
    assert "answer briefly." in folded.get_attribute("textContent")
    assert reply.find_element(By.CSS_SELECTOR, ".content strong").text == "there"
    assert "The user greets" not in reply.find_element(By.CSS_SELECTOR, ".content").text


def _load(server, count: int, max_tokens: int) -> list[str]:
    def one(i: int) -> str:
        body = {
            "prompt": f"Describe the number {i} in a few words:",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
            return client.post("/v1/completions", json=body).json()["id"]

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def _number(driver, element_id: str) -> float:
    text = _el(driver, "#" + element_id).text.replace(",", "")
    return float(text) if text not in ("", "–") else 0.0


def test_dashboard_counters_move_under_load(browser, main_server, shots):
    browser.get(main_server.url + "/dashboard")  # the key is in local storage already
    _wait(
        browser,
        lambda d: (
            _el(d, "#conn-state").get_attribute("data-state") == "live"
            and _el(d, "#finished-total").text not in ("", "–")
        ),
    )
    finished_before = _number(browser, "finished-total")
    generated_before = _number(browser, "generation-total")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(_load, main_server, 4, 32)
        seen = {"running": 0.0, "output_tok_s": 0.0}
        deadline = time.monotonic() + WAIT_S
        while not load.done() or _number(browser, "finished-total") < finished_before + 4:
            assert time.monotonic() < deadline, seen
            for key, element in (("running", "running"), ("output_tok_s", "output-tok-s")):
                seen[key] = max(seen[key], _number(browser, element))
            time.sleep(POLL_S)  # sampling what the page shows, bounded by the deadline
        ids = load.result()
    assert seen["running"] >= 1 and seen["output_tok_s"] > 0, seen
    assert _number(browser, "generation-total") >= generated_before + 4 * 32
    _wait(browser, lambda d: all(i in _el(d, "#recent-body").text for i in ids))
    assert _el(browser, "#ttft-p50").text != "–"
    browser.save_screenshot(str(shots / "dashboard-desktop-light.png"))
    _no_csp_violations(browser)


def test_phone_sized_dark_screens(browser, main_server, shots):
    browser.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
    )
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True},
    )
    try:
        browser.get(main_server.url + "/dashboard")
        _wait(
            browser,
            lambda d: (
                _el(d, "#conn-state").get_attribute("data-state") == "live"
                and _el(d, "#finished-total").text not in ("", "–")
            ),
        )
        dark = browser.execute_script("return matchMedia('(prefers-color-scheme: dark)').matches")
        assert dark
        # One column: nothing wider than the screen.
        assert browser.execute_script("return document.documentElement.scrollWidth") <= 390
        browser.save_screenshot(str(shots / "dashboard-phone-dark.png"))
        # Open the first conversation (its reply has a code block, most likely).
        browser.execute_script("""
          const all = JSON.parse(localStorage.getItem('pagoda.conversations'));
          localStorage.setItem('pagoda.currentConversation', all[all.length - 1].id);""")
        browser.get(main_server.url + "/")
        _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".message")) >= 2)
        assert (
            not _el(browser, "#sidebar").is_displayed() or _el(browser, "#sidebar").rect["x"] < 0
        )  # slid away until the menu button opens it
        assert browser.execute_script("return document.documentElement.scrollWidth") <= 390
        browser.save_screenshot(str(shots / "chat-phone-dark.png"))
        _no_csp_violations(browser)
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
