"""The memory page measured, and its pictures for the docs, in a real browser.

    python scripts/memory_page.py bench [--pairs 5]     what the page costs, how far behind it draws
    python scripts/memory_page.py screenshots           docs/images/memory-page-{live,replay}.png

`bench`: one process runs `minillm serve`'s app on the default model (uvicorn in a thread, as the tests do)
and sends it 32 streams at once, in interleaved pairs of runs: the page closed (the browser on
about:blank), then open (Debian's chromium, headless, on /memory). It prints:

  in process   the engine thread's time inside `KVEvents.emit` (the page's feed only collects a
               step's events there) as a share of step time; the event loop's time building and
               encoding frames, as a share of the run's wall time (it shares the GIL and the cores)
  end to end   tokens/s with the page closed and open, each pair's ratio, median and spread
  lag          the page's own measure: when it draws a frame, now minus the end of the step drawn
  replay       a 2,000-step trace: reading and walking it (`Replay`), then the page ready

The browser runs on the same two cores as the engine; the end-to-end ratio includes its drawing.

`screenshots`: a small pool under 16 chats sharing a system prompt, with a host tier to swap to,
drawn live once the pool is busy, then the same run (it is traced) replayed a few steps after its
first preemption.

Both need selenium and Debian's chromium + chromium-driver (the test extra and `.ci/run` bring them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import uvicorn
from selenium import webdriver

from minillm.config import EngineConfig
from minillm.engine import LLM, LLMEngine, SamplingParams
from minillm.memory.events import KVEvents
from minillm.serve.app import build_app
from minillm.serve.connections import serving_in_a_thread, uvicorn_config
from minillm.serve.engine_loop import EngineLoop
from minillm.serve.limits import ServeLimits
from minillm.serve.memory_page import build_replay_app
from minillm.trace import busiest, describe_runs
from minillm.tracing import read_trace, tracing
from minillm.view import Replay, ViewState

MODEL = Path("weights/SmolLM2-135M-Instruct")
SYSTEM = "You are a librarian. Answer in one short paragraph, citing the shelf of each book. " * 2


class Clock:
    """Seconds spent inside some functions, patched in place for the whole run."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - started

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken


def serving(app, config=uvicorn.Config):
    """`app` on a free port of 127.0.0.1, uvicorn in a thread: its base URL while the block runs."""
    return serving_in_a_thread(config(app, log_level="warning"), start_s=60, stop_s=60)


def serving_engine(engine: LLMEngine):
    limits = ServeLimits()
    app = build_app(EngineLoop(engine), MODEL.name, limits=limits)
    return serving(app, lambda app, **options: uvicorn_config(app, limits, **options))


def complete(url: str, prompt: str, max_tokens: int) -> int:
    body = json.dumps({"model": MODEL.name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    request = urllib.request.Request(
        url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.load(answer)["usage"]["completion_tokens"]


def one_run(url: str, streams: int, max_tokens: int, tag: int) -> float:
    """`streams` completions at once; tokens generated per second of the whole run."""
    counts = []
    prompts = [
        f"{SYSTEM}Question {tag}.{index}: which shelf holds book {index * 7 + tag}?"
        for index in range(streams)
    ]
    threads = [
        threading.Thread(target=lambda p=p: counts.append(complete(url, p, max_tokens))) for p in prompts
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert len(counts) == streams, "a request failed"
    return sum(counts) / (time.perf_counter() - started)


def browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    return webdriver.Chrome(service=webdriver.ChromeService("/usr/bin/chromedriver"), options=options)


def wait_ready(driver, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while driver.execute_script("return document.body && document.body.dataset.ready") != "1":
        assert time.monotonic() < deadline, "the page never drew its first frame"
        time.sleep(0.02)


def sample_lags(driver, stop: threading.Event, lags: list) -> None:
    """The page's lag (data-lag on #status, seconds), read twice a second while a run lasts."""
    while not stop.wait(0.5):
        lag = driver.execute_script("return document.querySelector('#status')?.dataset.lag")
        if lag not in (None, ""):
            lags.append(float(lag))


def live(args, driver) -> dict:
    engine = LLMEngine(EngineConfig(model_dir=MODEL, prefix_caching=True, max_num_seqs=args.streams))
    clock = Clock()
    clock.wrap(LLMEngine, "step", "step")
    clock.wrap(KVEvents, "emit", "emit")
    clock.wrap(ViewState, "apply", "view")
    clock.wrap(ViewState, "frame", "view")
    pairs, lags, in_process = [], [], []
    with serving_engine(engine) as url:
        one_run(url, args.streams, 8, tag=-1)  # warm-up
        for pair in range(args.pairs):
            driver.get("about:blank")
            closed = one_run(url, args.streams, args.max_tokens, tag=2 * pair)
            driver.get(url + "/memory")
            wait_ready(driver)
            clock.take()
            steps_before = engine.stats.steps
            stop = threading.Event()
            sampler = threading.Thread(target=sample_lags, args=(driver, stop, lags))
            sampler.start()
            started, browser_before = time.perf_counter(), browser_cpu_seconds()
            page_before = page_metrics(driver)
            opened = one_run(url, args.streams, args.max_tokens, tag=2 * pair + 1)
            wall = time.perf_counter() - started
            browser_cpu = browser_cpu_seconds() - browser_before
            page_spent = {name: value - page_before[name] for name, value in page_metrics(driver).items()}
            stop.set()
            sampler.join()
            spent = clock.take()
            step_s = spent["step"]
            in_process.append(
                {
                    "steps": engine.stats.steps - steps_before,
                    "emit_share_of_step_time": spent.get("emit", 0.0) / step_s,
                    "view_share_of_wall": spent.get("view", 0.0) / wall,
                    "browser_cores_busy": browser_cpu / wall,
                    "browser_cpu_s": browser_cpu,
                    **{f"page_{name}_s": value for name, value in page_spent.items()},
                }
            )
            pairs.append({"closed_tok_s": closed, "open_tok_s": opened, "ratio": opened / closed})
            print(f"pair {pair}: closed {closed:.0f} tok/s, open {opened:.0f} tok/s ({opened / closed:.3f}x)")
    return {"pairs": pairs, "in_process": in_process, "lags": lags}


def replay(args, driver) -> dict:
    """A trace of about `args.trace_steps` steps, read, walked and opened in the page."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.jsonl"
        with tracing(path):
            llm = LLM(MODEL, prefix_caching=True, max_num_seqs=4, kv_cache_bytes=48 << 20)
            prompts = [f"{SYSTEM}Question {index}: which shelf?" for index in range(args.trace_steps // 50)]
            llm.generate(prompts, SamplingParams(max_tokens=200, ignore_eos=True))
        started = time.perf_counter()
        runs = read_trace(path)
        events = runs[busiest(describe_runs(runs))]
        walked = Replay(events)
        walk_s = time.perf_counter() - started
        with serving(build_replay_app(walked, "bench")) as url:
            driver.get("about:blank")
            started = time.perf_counter()
            driver.get(url + "/memory")
            wait_ready(driver)
            page_s = time.perf_counter() - started
        return {"frames": len(walked), "events": len(events), "walk_s": walk_s, "page_ready_s": page_s}


def page_metrics(driver) -> dict[str, float]:
    """Chrome's own seconds so far on the page's main thread: all its tasks, scripts, layout."""
    driver.execute_cdp_cmd("Performance.enable", {})
    metrics = {m["name"]: m["value"] for m in driver.execute_cdp_cmd("Performance.getMetrics", {})["metrics"]}
    return {
        "task": metrics["TaskDuration"],
        "script": metrics["ScriptDuration"],
        "layout": metrics["LayoutDuration"],
    }


def browser_cpu_seconds() -> float:
    """CPU seconds used so far by every chromium process (the browser, its renderer, its GPU
    process), from /proc."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
        except OSError:  # gone meanwhile
            continue
        if "chrom" in fields[0]:
            utime, stime = fields[1].split()[11:13]
            total += (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
    return total


def spread(values: list[float], scale: float = 1.0, unit: str = "") -> str:
    """Median (min-max) of `values`, each times `scale`."""
    low, mid, high = (scale * value for value in (min(values), statistics.median(values), max(values)))
    return f"{mid:.3g}{unit} ({low:.3g}-{high:.3g}{unit})"


def bench(args, driver) -> None:
    results = {"live": live(args, driver), "replay": replay(args, driver)}
    pairs, in_process = results["live"]["pairs"], results["live"]["in_process"]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    results["machine"] = {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
    }
    results["date"] = time.strftime("%Y-%m-%d")
    print(
        f"\n{results['date']}, {cpu}, {args.streams} streams x {args.max_tokens} tokens, {args.pairs} pairs"
    )
    emit = spread([run["emit_share_of_step_time"] for run in in_process], 100, "%")
    view = spread([run["view_share_of_wall"] for run in in_process], 100, "%")
    browser_load = spread([run["browser_cores_busy"] for run in in_process])
    lags = results["live"]["lags"]
    walked = results["replay"]
    print(f"page open / closed tok/s: {spread([pair['ratio'] for pair in pairs])}")
    print(f"engine thread inside emit, share of step time: {emit}")
    print(f"event loop building frames, share of wall time: {view}")
    print(f"the browser's CPU while the page was open, in cores busy: {browser_load}")
    for part in ("task", "script", "layout"):
        seconds = spread([run[f"page_{part}_s"] for run in in_process])
        print(f"the page's main thread, {part} seconds per open run: {seconds}")
    print(f"the browser's CPU seconds per open run: {spread([run['browser_cpu_s'] for run in in_process])}")
    print(f"lag drawn: median {statistics.median(lags):.3f} s, max {max(lags):.3f} s ({len(lags)} samples)")
    print(
        f"replay: {walked['frames']} frames ({walked['events']} events) walked in {walked['walk_s']:.2f} s; "
        f"page ready in {walked['page_ready_s']:.2f} s"
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def screenshots(args, driver) -> None:
    """The live page of a busy server, then its traced run replayed a few steps after the first
    preemption (swapped blocks in the host tier)."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.jsonl"
        with tracing(path):
            config = EngineConfig(
                model_dir=MODEL,
                prefix_caching=True,
                kv_cache_bytes=48 << 20,
                host_cache_bytes=48 << 20,
                preemption="swap",
                max_num_seqs=16,
            )
            with serving_engine(LLMEngine(config)) as url:
                driver.get(url + "/memory")
                wait_ready(driver)
                prompts = [
                    f"{SYSTEM}Question {index}: which shelf holds book {index}?" for index in range(16)
                ]
                threads = [threading.Thread(target=complete, args=(url, prompt, 160)) for prompt in prompts]
                for thread in threads:
                    thread.start()
                busy = (
                    "const c = document.querySelector('#device-counts').dataset; return +c.free + +c.cached"
                )
                blocks = int(driver.find_element("id", "grid-device").get_attribute("data-blocks"))
                deadline = time.monotonic() + 300
                while driver.execute_script(busy) > blocks // 10 and time.monotonic() < deadline:
                    time.sleep(0.1)
                time.sleep(2)  # a few steps more: the queue and the log fill in
                driver.save_screenshot(str(args.out_dir / "memory-page-live.png"))
                for thread in threads:
                    thread.join(timeout=600)
                driver.get("about:blank")
        runs = read_trace(path)
        walked = Replay(runs[busiest(describe_runs(runs))])
    counters = walked.summary()["counters"]
    preempted = [index for index, numbers in enumerate(counters) if numbers["preemptions"]]
    shown = min(preempted[0] + 3, len(counters) - 1) if preempted else len(counters) // 2
    with serving(build_replay_app(walked, "run.jsonl · run 0")) as url:
        driver.get(url + "/memory")
        wait_ready(driver)
        driver.execute_script(
            f"const s = document.querySelector('#scrubber'); s.value = {shown};"
            "s.dispatchEvent(new Event('input'))"
        )
        time.sleep(1)
        driver.save_screenshot(str(args.out_dir / "memory-page-replay.png"))
    print(f"wrote {args.out_dir}/memory-page-live.png and memory-page-replay.png (frame {shown})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    measure = commands.add_parser("bench", help="what the page costs, how far behind it draws")
    measure.add_argument("--pairs", type=int, default=5, help="interleaved closed/open pairs (default: 5)")
    measure.add_argument("--streams", type=int, default=32, help="requests at once (default: 32)")
    measure.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: 64)")
    measure.add_argument("--trace-steps", type=int, default=2000, help="the replayed trace's steps")
    measure.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here too")
    pictures = commands.add_parser("screenshots", help="the docs' pictures of the page, live and replayed")
    pictures.add_argument("--out-dir", type=Path, default=Path("docs/images"), help="(default: docs/images)")
    args = parser.parse_args()
    driver = browser()
    try:
        {"bench": bench, "screenshots": screenshots}[args.command](args, driver)
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
