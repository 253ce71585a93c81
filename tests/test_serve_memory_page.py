"""The memory page (`/memory`) in a real browser: Debian's chromium, headless, driven by Selenium
through Debian's chromedriver. The page loads with no console message, draws one square per
block of the pool, shows a request the server runs and its blocks changing state, shows a prefix
hit as shared, asks for the API key when the server has one, and replays a trace forward and back.
Its routes (the CSP, the files, the read-only data) are checked over plain HTTP first. Screenshots
go to the test's temporary folder; the docs' come from `scripts/memory_page_screenshots.py`."""

import json
import shutil
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn
from helpers import tiny_with_real_tokenizer
from selenium import webdriver
from serving import fetch, running_app, running_server

from minillm.config import EngineConfig
from minillm.engine import LLM, LLMEngine, SamplingParams
from minillm.serve.engine_loop import EngineLoop
from minillm.serve.memory_page import CSP, build_replay_app
from minillm.tracing import read_trace, tracing
from minillm.view import Replay

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
WAIT_S = 20  # the longest any condition in a browser may take to come true
KEY = "s3cret-key"
LONG_PROMPT = "The library's rules, read to every visitor before a question: " * 6


@pytest.fixture(scope="module")
def model_dir(real_dir, tmp_path_factory):
    return tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("page-model"), real_dir, max_position_embeddings=1024
    )


def engine_loop(model_dir) -> EngineLoop:
    config = EngineConfig(model_dir=model_dir, kv_cache_bytes=1 << 20, prefix_caching=True, block_size=16)
    return EngineLoop(LLMEngine(config), threads=1)


NO_BROWSER = not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER))
needs_browser = pytest.mark.skipif(
    NO_BROWSER, reason="the browser tests drive Debian's chromium: apt-get install chromium chromium-driver"
)


@pytest.fixture(scope="module")
def browser():
    """One headless chromium for the module; its console log is read (and so emptied) by each test."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, script: str, what: str, timeout: float = WAIT_S):
    """The value of `script` (JavaScript returning something) once it is truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"the page never showed {what} within {timeout} s")


def console_messages(driver) -> list[str]:
    """Every console message at warning level or above since the last call (chromium's log)."""
    return [
        entry["message"] for entry in driver.get_log("browser") if entry["level"] in ("WARNING", "SEVERE")
    ]


def open_page(driver, url: str, tmp_path, name: str) -> None:
    driver.get(url + "/memory")
    wait_for(driver, "return document.body.dataset.ready === '1'", "its first frame")
    driver.save_screenshot(str(tmp_path / f"{name}.png"))


ROWS = "[...document.querySelectorAll('#requests .request')]"  # JavaScript: the page's request rows


@contextmanager
def sent(url: str, prompt: str, max_tokens: int):
    """A completion running in a thread while the block runs; its answer checked at the end."""
    answers = []
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    thread = threading.Thread(
        target=lambda: answers.append(
            fetch(
                url + "/v1/completions",
                body,
                {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
            )
        )
    )
    thread.start()
    try:
        yield
    finally:
        thread.join(timeout=60)
    assert answers and answers[0].status_code == 200, answers


def test_the_routes_serve_a_strict_read_only_page(model_dir):
    with running_server(engine_loop(model_dir), api_key=KEY, metrics="keyed") as url:
        page = fetch(url + "/memory")
        assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
        assert "<script" in page.text and "<script>" not in page.text  # a script file, never inline
        script = fetch(url + "/memory/static/memory.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert fetch(url + "/memory/static/..%2fframes.py").status_code == 404
        assert fetch(url + "/memory/info").json() == {  # asked before the key: no model named
            "mode": "live",
            "needs_key": True,
            "model": "",
            "title": "minillm · memory",
        }
        assert fetch(url + "/memory/stream").status_code == 401  # the data takes the key, as /metrics
        assert fetch(url + "/").status_code == 307
        assert fetch(url + "/memory", headers={"Host": "evil.example"}).status_code == 403
    with running_server(engine_loop(model_dir), metrics="off") as url:
        assert fetch(url + "/memory").status_code == 404  # /metrics off: no page either


@needs_browser
def test_a_live_page_draws_the_pool_a_request_and_a_prefix_hit(model_dir, browser, tmp_path):
    loop = engine_loop(model_dir)
    num_blocks = loop.engine.snapshot().num_blocks
    with running_server(loop, api_key=KEY, metrics="keyed") as url:
        browser.get(url + "/memory")
        wait_for(
            browser,
            "return document.querySelector('#key-form') && !document.querySelector('#key-form').hidden",
            "the key form",
        )
        browser.find_element("id", "key-input").send_keys(KEY)
        browser.find_element("id", "key-submit").click()
        wait_for(browser, "return document.body.dataset.ready === '1'", "its first frame")
        drawn = int(browser.find_element("id", "grid-device").get_attribute("data-blocks"))
        assert drawn == num_blocks
        with sent(url, LONG_PROMPT, 300):
            row = wait_for(
                browser,
                f"return {ROWS}.map(r => r.dataset.states).find(s => s.length > 0)",
                "a running request's blocks",
            )
            wait_for(
                browser,
                f"return {ROWS}.some(r => r.dataset.states.length > {len(row)})",
                "its table grow",
            )
        wait_for(
            browser,
            "return +document.querySelector('#device-counts').dataset.cached > 0",
            "its blocks cached",
        )
        with sent(url, LONG_PROMPT, 300):  # the same prompt: its full blocks come from the prefix cache
            hit = wait_for(
                browser,
                f"return {ROWS}.find(r => +r.dataset.hit > 0)?.dataset",
                "a prefix hit",
            )
            assert hit["states"].startswith("s")  # held and findable: shared
        browser.save_screenshot(str(tmp_path / "live.png"))
        assert console_messages(browser) == []
        browser.get("about:blank")  # the page's stream closes before the server stops


@needs_browser
def test_a_trace_replays_forward_and_back(tiny_dir, tiny_model, browser, tmp_path):
    path = tmp_path / "run.jsonl"
    with tracing(path):
        llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=1 << 16, prefix_caching=True)
        prompts = [[7, 8, 9, 10, 11, 12, 13, 14, index] for index in range(6)]
        llm.generate(prompts, SamplingParams(max_tokens=12))
    replay = Replay(read_trace(path)[0])
    app = build_replay_app(replay, "run.jsonl · run 0")
    with running_app(uvicorn.Config(app, log_level="warning")) as url:
        open_page(browser, url, tmp_path, "replay")
        assert browser.find_element("id", "mode").get_attribute("textContent") == "replay"
        step = lambda: browser.find_element("id", "step").get_attribute("textContent")  # noqa: E731
        first = step()
        browser.find_element("id", "forward").click()
        wait_for(
            browser, f"return document.querySelector('#step').textContent !== '{first}'", "the next step"
        )
        browser.find_element("id", "back").click()
        wait_for(
            browser, f"return document.querySelector('#step').textContent === '{first}'", "the step before"
        )
        last = len(replay) - 1
        browser.execute_script(
            f"const s = document.querySelector('#scrubber'); s.value = {last};"
            "s.dispatchEvent(new Event('input'))"
        )
        final = json.loads(replay.frame(last))
        for index in ("abc", "1.0", "-1", str(len(replay))):
            assert fetch(f"{url}/memory/frames/{index}").status_code == 404
        wait_for(
            browser,
            f"return document.querySelector('#step').textContent === '{final['step']}'",
            "the last step",
        )
        assert console_messages(browser) == []
