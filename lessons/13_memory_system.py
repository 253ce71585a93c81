"""Lesson 13 — the memory system as a whole: capacity, bandwidth, scheduling, and one byte's life.

Every earlier lesson turned one switch. Serving turns them all at once, and the KV cache stops
being a buffer and becomes a memory system: someone must decide which memory goes to whom, in
what form, for how long. This lesson looks at the whole, with the real model:
  (a) the three problems, each one row of `minillm bench memory --quick` on the same trace and
      budget:
      capacity (max-length reservation -> paged blocks: how many requests fit at once),
      bandwidth (fp32 -> int8 KV: bytes per token, so more requests in the same pool: tokens per
      second and goodput, on a decode-heavy trace where the pool binds), scheduling (first come first
      served -> memory-aware admission, with a host tier to swap to: time to first token, on the
      float32 rows, where memory is short);
  (b) one busy step, every byte of KV placed: device or host, shared or private, cached for
      later, quantized or still in full precision (a filling block's keys), kept or evicted;
  (c) a request whose KV is quantized, partly evicted and paged needs an old token again (a
      password given at the start, asked for at the end): what each switch costs then — in
      quality (what the model now believes) and in time (what getting the token back takes);
  (d) scheduling on traffic it was not tuned on (`minillm bench scheduling`, shortened): fcfs,
      lpm and memory-aware admission (each request priced by the KV it will hold over its
      predicted life, and told the TTFT target) on a held-out seed of the mixed trace arriving
      six times as fast as fcfs gets through a burst of the tuning seed's, memory-aware admission
      without the target, and fcfs against lpm on short questions (sharing only the chat
      template's first block). What it teaches beside the numbers: pricing a request by its
      *peak* KV (the price the life cost replaced; `bench scheduling`, 2026-12-06, docs/memory.md)
      avoided preemptions and won nothing, because preemptions cost a few % of busy time; the
      order is what pays.

    python lessons/13_memory_system.py [--quick] [--out DIR]
"""

import random
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from _common import console, lesson_args, require_model, save_numbers, save_plot, table  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

from minillm.benchmarks.memory import bench_memory  # noqa: E402
from minillm.benchmarks.scheduling.bench import (  # noqa: E402
    POLICIES,
    TUNING_SEED,
    calibrate,
    capacity_rate,
    serve_trace,
)
from minillm.benchmarks.scheduling.trace import KINDS, QUESTIONS_ONLY, make_trace  # noqa: E402
from minillm.config import DTYPES, resolve_dtype  # noqa: E402
from minillm.engine import LLM, SamplingParams  # noqa: E402
from minillm.evaluation import read_text  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402
from minillm.weights import load_model  # noqa: E402

BLOCK = 16
# per mode: (a) the bench trace (its --quick lengths), how many requests; (b) the busy step; (c) the prompt
SETTINGS = {
    "default": {
        "bench_requests": 16,
        "busy_requests": 12,
        "busy_system_tokens": 96,
        "busy_device_blocks": 40,
        "busy_host_blocks": 40,
        "filler_tokens": 400,
        "sched_requests": 40,
    },
    "quick": {
        "bench_requests": 6,
        "busy_requests": 6,
        "busy_system_tokens": 48,
        "busy_device_blocks": 16,
        "busy_host_blocks": 16,
        "filler_tokens": 120,
        "sched_requests": 4,
    },
}
STATES = ["free", "cached", "shared", "private", "host: swapped", "host: spilled"]
COLORS = ["#eeeeee", "#9ecae1", "#31a354", "#fd8d3c", "#756bb1", "#bcbddc"]


# ---------------------------------------------------------------- (a) three problems, three rows of the bench
SHOWN_ROWS = ("reserve", "paged", "prefix", "int8", "lossless")  # the bench's rows this lesson compares


def three_problems(model_dir, settings: dict) -> dict:
    """`minillm bench memory` at its --quick lengths (no load tests); the rows each problem compares
    (scheduling: (3) first come first served against (L), memory-aware with a host tier, both fp32)."""
    report = bench_memory(  # no clients share the cores here (load=False): every torch thread
        model_dir,
        quick=True,
        num_requests=settings["bench_requests"],
        load=False,
        threads=torch.get_num_threads(),
        rows=SHOWN_ROWS,
    )
    rows = report["rows"]
    return {
        "rows": rows,
        "budget_blocks": rows["paged"]["device_blocks"],
        "trace": report["trace"],
        "capacity": (rows["reserve"], rows["paged"]),
        "bandwidth": (rows["prefix"], rows["int8"]),
        "scheduling": (rows["prefix"], rows["lossless"]),
    }


def show_problems(problems: dict) -> None:
    (reserve, paged), (fp32, int8), (fcfs, memory) = (
        problems[k] for k in ("capacity", "bandwidth", "scheduling")
    )
    rows = [
        [
            "capacity: requests at once",
            f"{reserve['label']}: {reserve['peak_seqs']}",
            f"{paged['label']}: {paged['peak_seqs']}",
            f"{paged['output_tok_s']:.1f} vs {reserve['output_tok_s']:.1f} tok/s",
        ],
        [
            "bandwidth: KV bytes per token -> requests at once",
            f"{fp32['label']}: {fp32['kv_bytes_per_token']:,} B, {fp32['peak_seqs']}",
            f"{int8['label']}: {int8['kv_bytes_per_token']:,} B, {int8['peak_seqs']}",
            f"{int8['output_tok_s']:.1f} vs {fp32['output_tok_s']:.1f} tok/s; goodput "
            f"{int8['goodput']:.0%} vs {fp32['goodput']:.0%}",
        ],
        [
            "scheduling: TTFT p50 / p99",
            f"{fcfs['label']}: {fcfs['ttft_p50_s']:.2f} / {fcfs['ttft_p99_s']:.2f} s",
            f"{memory['label']}: {memory['ttft_p50_s']:.2f} / {memory['ttft_p99_s']:.2f} s",
            f"goodput {memory['goodput']:.0%} vs {fcfs['goodput']:.0%}",
        ],
    ]
    table(
        f"(a) {problems['trace']['requests']} requests on one KV budget "
        f"({problems['budget_blocks']} fp32 blocks): each problem, the row before and after its fix",
        ["problem", "before", "after", "beside it"],
        rows,
    )


# ---------------------------------------------------------------- (b) one busy step, every byte placed
def busy_engine(model, tokenizer, text_ids: list[int], settings: dict) -> LLM:
    """Chats sharing two system prompts, arriving at once at a small int8 device pool with a
    host tier behind it, the prefix cache on, and H2O keeping 24 private entries per sequence
    beside its shared prompt blocks (every step, so that the picture has evicted entries in it)."""
    bytes_per_token = model.config.kv_bytes_per_token(model.dtype)
    return LLM(
        model=model,
        tokenizer=tokenizer,
        block_size=BLOCK,
        prefix_caching=True,
        kv_dtype="int8",
        kv_cache_bytes=settings["busy_device_blocks"] * BLOCK * bytes_per_token // 3,  # int8 is ~3.5x smaller
        host_cache_bytes=settings["busy_host_blocks"] * BLOCK * bytes_per_token // 3,
        preemption="swap",
        eviction="h2o",
        kv_budget=24,
        admission="memory",
    )


def placement(memory) -> dict:
    """Where the KV bytes are in a `MemorySnapshot`: each device and host block's state, and bytes
    per category. A filling block is a private one (its full-precision keys are counted apart)."""
    per_block = memory.bytes_per_token * memory.block_size
    device = ["private" if state == "filling" else state for state in memory.blocks["device"]]
    host = [
        "host: swapped"
        if state in ("shared", "private")
        else "host: spilled"
        if state == "cached"
        else "free"
        for state in memory.blocks.get("host", ())
    ]
    running = memory.running()
    evicted = sum(seq.num_computed - seq.num_cached for seq in running)
    return {
        "device": device,
        "host": host,
        "bytes": {
            **{f"device {state}": device.count(state) * per_block for state in STATES[1:4]},
            "host swapped": host.count("host: swapped") * per_block,
            "host spilled": host.count("host: spilled") * per_block,
            "full precision (filling blocks' keys)": memory.staged_bytes,
            "evicted (no longer stored)": evicted * memory.bytes_per_token,
        },
        "running": len(running),
        "waiting": len(memory.waiting()),
    }


def busiest_step(model, tokenizer, text_ids: list[int], settings: dict) -> dict:
    """Serve the chats and keep the placement of the step with the most KV held."""
    llm = busy_engine(model, tokenizer, text_ids, settings)
    engine, rng = llm.engine, random.Random(3)
    systems = [text_ids[i * 2000 : i * 2000 + settings["busy_system_tokens"]] for i in range(2)]
    for _ in range(settings["busy_requests"]):
        start = rng.randrange(len(text_ids) - 64)
        engine.add_request(
            rng.choice(systems) + text_ids[start : start + rng.randint(16, 64)],
            SamplingParams(max_tokens=rng.randint(24, 64), ignore_eos=True),
        )
    best, held = None, -1
    while engine.has_unfinished_requests():
        engine.step()
        now = placement(engine.snapshot())
        if sum(now["bytes"].values()) - now["bytes"]["device cached"] > held:
            best, held = now, sum(now["bytes"].values()) - now["bytes"]["device cached"]
    best["rungs"] = dict(engine.stats.rungs)
    best["bytes_per_token"] = engine.snapshot().bytes_per_token
    return best


def show_busy(busy: dict) -> None:
    rows = [[name, f"{value / 2**20:.2f}"] for name, value in busy["bytes"].items()]
    table(
        f"(b) the busiest step: {busy['running']} running, {busy['waiting']} waiting "
        f"(int8 KV, {busy['bytes_per_token']:,} B per token; ladder so far: {busy['rungs']})",
        ["where", "MiB"],
        rows,
    )


# ---------------------------------------------------------------- (c) an old token needed again
class LastLogits:
    """A sampler that keeps the log-probabilities it was shown and answers greedily."""

    def __init__(self):
        self.logprobs = None

    def __call__(self, logits: torch.Tensor) -> int:
        self.logprobs = torch.log_softmax(logits.float(), dim=-1)
        return int(logits.argmax())


def password_prompt(tokenizer, text_ids: list[int], settings: dict) -> tuple[list[int], int]:
    """A password early in the prompt, a stretch of Alice, then the question; the answer's first token."""
    prompt = (
        tokenizer.encode("Alice wrote a note. The password is Pumpkin. Remember it.\n")
        + text_ids[5000 : 5000 + settings["filler_tokens"]]
        + tokenizer.encode("\nThe password is")
    )
    return prompt, tokenizer.encode(" Pumpkin")[0]


def answer_with(model, tokenizer, prompt: list[int], **switches) -> tuple[torch.Tensor, float]:
    """The next-token log-probabilities after `prompt`, prefilled in chunks of 64 so that what
    eviction drops is really gone when the question is read; and the seconds it took."""
    llm = LLM(model=model, tokenizer=tokenizer, block_size=BLOCK, max_num_batched_tokens=64, **switches)
    engine = llm.engine
    recorder = LastLogits()
    engine.add_request(prompt, SamplingParams(max_tokens=1), sampler=recorder)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return recorder.logprobs, time.perf_counter() - start


def copy_seconds(num_bytes: int) -> float:
    """Time to copy `num_bytes` from one buffer to another (what a swap-in moves), best of 3."""
    source, destination = torch.empty(num_bytes, dtype=torch.uint8), torch.empty(num_bytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        destination.copy_(source)
        best = min(best, time.perf_counter() - start)
    return best


def old_token(model, tokenizer, text_ids: list[int], settings: dict) -> dict:
    prompt, answer = password_prompt(tokenizer, text_ids, settings)
    exact, prefill_seconds = answer_with(model, tokenizer, prompt)
    fp32_bytes = model.config.kv_bytes_per_token(model.dtype) * len(prompt)
    cases = {
        "paged": ("paged, fp32 (exact)", {}, "found through the block table: no copy, no loss"),
        "int8": ("int8 KV", {"kv_dtype": "int8"}, "stored with error: nothing to get back"),
        "int4": ("int4 KV", {"kv_dtype": "int4"}, "stored with error: nothing to get back"),
        "h2o": ("H2O keeps 20%", {"eviction": "h2o", "kv_budget": 0.2}, "gone: recompute the prompt"),
        "sinks": (
            "sinks + window 20%",
            {"eviction": "sinks", "kv_budget": 0.2},
            "gone: recompute the prompt",
        ),
        "window": ("window 20%", {"eviction": "window", "kv_budget": 0.2}, "gone: recompute the prompt"),
    }
    rows = {}
    for key, (label, switches, remedy) in cases.items():
        logprobs = exact if not switches else answer_with(model, tokenizer, prompt, **switches)[0]
        rows[key] = {
            "label": label,
            "p_answer": logprobs[answer].exp().item(),
            "top1_is_answer": int(logprobs.argmax()) == answer,
            "kl": float((exact.exp() * (exact - logprobs)).sum()),
            "remedy": remedy,
            "remedy_seconds": prefill_seconds if "recompute" in remedy else 0.0,
        }
    rows["swapped"] = {
        **rows["paged"],
        "label": "swapped to host, fp32",
        "remedy": "on the host: copy its blocks back",
        "remedy_seconds": copy_seconds(fp32_bytes),
    }
    return {
        "rows": rows,
        "prompt_tokens": len(prompt),
        "prefill_seconds": prefill_seconds,
        "answer": tokenizer.decode([answer]),
    }


def show_old_token(old: dict) -> None:
    rows = [
        [
            r["label"],
            f"{r['p_answer']:.3f}",
            "yes" if r["top1_is_answer"] else "no",
            f"{r['kl']:.3f}",
            r["remedy"],
            f"{r['remedy_seconds'] * 1e3:.1f}",
        ]
        for r in old["rows"].values()
    ]
    table(
        f"(c) a {old['prompt_tokens']}-token prompt asks for the password given in its first line "
        f"(answer starts {old['answer']!r})",
        ["KV", "p(answer)", "top-1 right", "KL vs exact", "to get the old token back", "ms"],
        rows,
    )


# ---------------------------------------------------------------- (d) scheduling on held-out traffic
SCHED_SIZES = {"scale": 0.25, "kv_tokens": 320}  # `bench scheduling --quick`'s lengths and pool
HELD_OUT_SEED = 1
# each traffic arrives at this many times the rate fcfs gets through a burst of it: on a trace this
# short a queue long enough to miss the TTFT target forms only so (at 2x, fcfs met 95% of the targets)
OVERLOAD = 6
TRAFFIC = {
    "mixed": (KINDS, (*POLICIES, "memory, no TTFT target")),
    "questions only": (QUESTIONS_ONLY, ("fcfs", "lpm")),
}


def held_out_scheduling(model_dir, settings: dict) -> dict:
    """Per traffic: the SLOs and fcfs's capacity from the tuning seed, then the policies on a
    held-out seed at OVERLOAD times that rate. In the machine's fastest precision (bf16 where it computes it
    natively): the runs are many, and a lossless policy's tokens are checked in float32 by the
    bench and the tests, not here."""
    dtype = resolve_dtype("auto")
    model, tokenizer = load_model(model_dir, DTYPES[dtype]), Tokenizer(model_dir)
    sizes, common = {**SCHED_SIZES, "requests": settings["sched_requests"]}, {"dtype": dtype, "device": "cpu"}
    tuning = make_trace(tokenizer, TUNING_SEED, sizes["requests"], 1.0, sizes["scale"])
    slo = calibrate(model, tokenizer, tuning, common)
    results, rates = {}, {}
    for traffic, (mix, policies) in TRAFFIC.items():
        rates[traffic] = OVERLOAD * capacity_rate(model, tokenizer, sizes, slo, common, mix)
        trace = make_trace(tokenizer, HELD_OUT_SEED, sizes["requests"], rates[traffic], sizes["scale"], mix)
        for policy in policies:
            run = serve_trace(model, tokenizer, trace, policy, sizes, slo, common)
            kept = ("goodput", "ttft_p50_s", "ttft_p99_s", "preemptions")
            results[(traffic, policy)] = {key: run[key] for key in kept}
    return {"slo": slo, "rates": rates, "results": results, "dtype": dtype}


def show_scheduling(sched: dict) -> None:
    rows = [
        [
            traffic,
            f"{sched['rates'][traffic]:.2f}",
            policy,
            f"{run['goodput']:.0%}",
            f"{run['ttft_p50_s']:.2f} / {run['ttft_p99_s']:.2f}",
            run["preemptions"],
        ]
        for (traffic, policy), run in sched["results"].items()
    ]
    slo = sched["slo"]
    table(
        f"(d) held-out seed {HELD_OUT_SEED}, each traffic at {OVERLOAD}x fcfs's rate on a burst of the "
        "tuning seed "
        f"({sched['dtype']}); SLOs TTFT <= {slo['ttft_s']:.2f} s, TPOT <= {slo['tpot_s'] * 1e3:.0f} ms",
        ["traffic", "arrivals/s", "policy", "goodput", "TTFT p50 / p99 s", "preemptions"],
        rows,
    )


def times(count: int) -> str:
    return f"{count} time" + ("" if count == 1 else "s")


def scheduling_meaning(sched: dict) -> str:
    def run(traffic, policy):
        return sched["results"][(traffic, policy)]

    mixed = {policy: run("mixed", policy) for policy in TRAFFIC["mixed"][1]}
    memory, fcfs, blind = mixed["memory"], mixed["fcfs"], mixed["memory, no TTFT target"]
    paid = memory["goodput"] > fcfs["goodput"]
    verdict = "paid" if paid else "did not pay"
    if fcfs["goodput"] >= 0.95:
        verdict += " (nothing queued long: fcfs met both SLOs too, and there was little to choose)"
    target = (
        f"knowing who can still meet the target added {(memory['goodput'] - blind['goodput']) * 100:.0f} "
        "points"
        if memory["goodput"] > blind["goodput"]
        else "ordering by predicted life alone does as well on count here; the target is there for the "
        "requests that order leaves for last (`bench scheduling`: the documents)"
    )
    why = (
        ": the gain is not preemptions avoided (a policy that only avoided them won a few % at most) "
        "but who waits: the requests that can still meet the target go first, those that hold little KV "
        "for little time before the others, and one that can no longer meet it waits, at the tail's cost "
        f"(p99 TTFT {memory['ttft_p99_s']:.2f} s against {fcfs['ttft_p99_s']:.2f})"
        if paid
        else ""
    )
    plain = {policy: run("questions only", policy)["goodput"] for policy in TRAFFIC["questions only"][1]}
    gap = plain["lpm"] - plain["fcfs"]
    plain_said = (
        f"On short questions, which share only the chat template's first block, lpm served "
        f"{plain['lpm']:.0%} against fcfs's {plain['fcfs']:.0%}"
        + (
            ": with no longer prefix to prefer it orders as fcfs does. "
            if abs(gap) < 0.02
            else f" ({gap * 100:+.0f} points, no longer prefix to prefer: one seed's noise is that large). "
        )
    )
    return (
        f"(d) On mixed traffic it was not tuned on, memory-aware admission served {memory['goodput']:.0%} "
        f"of requests within both SLOs against fcfs's {fcfs['goodput']:.0%} and lpm's "
        f"{mixed['lpm']['goodput']:.0%}: choosing who joins {verdict} on this seed. Without the TTFT "
        f"target it served {blind['goodput']:.0%}: {target}. It preempted {times(memory['preemptions'])}, "
        f"fcfs {times(fcfs['preemptions'])}{why}. {plain_said}"
        "One seed moves by tens of points; `minillm bench scheduling` reports five held-out seeds at "
        "three loads, with their spread."
    )


# ---------------------------------------------------------------- plot, numbers, meaning
def plot(problems: dict, busy: dict, old: dict, sched: dict, out_dir) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(19, 9))
    (ax_fixes, ax_map, ax_bytes), (ax_old, ax_sched, ax_spare) = axes
    ax_spare.set_axis_off()
    plot_fixes(ax_fixes, problems)
    width, blank = 16, len(STATES)  # cells per row; the colour of the padding after each tier's last block
    rows_of = lambda states: [STATES.index(s) for s in states] + [blank] * (-len(states) % width)  # noqa: E731
    grid = rows_of(busy["device"]) + rows_of(busy["host"])
    ax_map.imshow(
        torch.tensor(grid).reshape(-1, width),
        cmap=ListedColormap(COLORS + ["white"]),
        vmin=0,
        vmax=blank,
        aspect="auto",
    )
    ax_map.axhline(-(-len(busy["device"]) // width) - 0.5, color="black", linewidth=2)
    ax_map.set_title(
        f"(b1) every block at the busiest step\n(above the line: device, {len(busy['device'])} blocks; "
        f"below: host, {len(busy['host'])})"
    )
    ax_map.set_xticks([])
    ax_map.set_yticks([])
    for state, color in zip(STATES, COLORS):
        ax_map.bar(0, 0, color=color, label=state)
    ax_map.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), fontsize=8, ncol=3)
    names, values = zip(*busy["bytes"].items())
    bars = ax_bytes.barh(names, [v / 2**20 for v in values], color="#4c72b0")
    ax_bytes.bar_label(bars, [f" {v / 2**20:.2f}" for v in values], fontsize=8)
    ax_bytes.margins(x=0.15)
    ax_bytes.set_xlabel("MiB")
    ax_bytes.invert_yaxis()
    ax_bytes.set_title("(b2) the same step's KV bytes, by place and form")
    bars = ax_old.barh(
        [r["label"] for r in old["rows"].values()],
        [r["p_answer"] for r in old["rows"].values()],
        color="#dd8452",
    )
    ax_old.bar_label(bars, [f" {r['p_answer']:.3f}" for r in old["rows"].values()], fontsize=8)
    ax_old.margins(x=0.15)
    ax_old.set_xlabel("p(the password's first token)")
    ax_old.set_title("(c) the old token, read again")
    ax_old.invert_yaxis()
    labels = [f"{traffic}: {policy}" for traffic, policy in sched["results"]]
    bars = ax_sched.barh(labels, [run["goodput"] for run in sched["results"].values()], color="#55a868")
    ax_sched.bar_label(bars, [f" {run['goodput']:.0%}" for run in sched["results"].values()], fontsize=8)
    ax_sched.set_xlim(0, 1.1)
    ax_sched.set_xlabel(f"goodput (both SLOs met), held-out seed {HELD_OUT_SEED}")
    ax_sched.set_title("(d) admission policies on held-out traffic" + flat_traffic(sched["results"]))
    ax_sched.invert_yaxis()
    fig.tight_layout()
    save_plot(fig, out_dir, "13_memory_system.png")


def flat_traffic(results: dict) -> str:
    """A line for each traffic whose policies all had the same goodput: that load did not separate them."""
    said = ""
    for traffic in dict.fromkeys(traffic for traffic, _ in results):
        goodputs = {round(run["goodput"], 6) for (t, _), run in results.items() if t == traffic}
        if len(goodputs) == 1:
            said += f"\n{traffic}: all at {goodputs.pop():.0%}, this load does not separate them"
    return said


def plot_fixes(ax, problems: dict) -> None:
    """(a): each problem's fix as a ratio, after / before, on the same trace and bytes (1 = no change)."""
    (reserve, paged), (fp32, int8), (fcfs, memory) = (
        problems[k] for k in ("capacity", "bandwidth", "scheduling")
    )
    ratios = {
        "capacity: requests at once,\npaging / reserving": paged["peak_seqs"] / reserve["peak_seqs"],
        "bandwidth: requests at once,\nint8 / fp32": int8["peak_seqs"] / fp32["peak_seqs"],
        "scheduling: goodput,\nmemory-aware / fcfs": memory["goodput"] / max(fcfs["goodput"], 1e-9),
    }
    bars = ax.barh(list(ratios), list(ratios.values()), color="#8172b3")
    ax.bar_label(bars, [f" {r:.2f}x" for r in ratios.values()], fontsize=8)
    ax.margins(x=0.15)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("after / before (1 = no change)")
    ax.set_title("(a) three problems, each fix's ratio")
    ax.invert_yaxis()


def meaning(problems: dict, busy: dict, old: dict) -> str:
    (reserve, paged), (fp32, int8), (fcfs, memory) = (
        problems[k] for k in ("capacity", "bandwidth", "scheduling")
    )
    speedup = int8["output_tok_s"] / fp32["output_tok_s"]
    speed = (
        f"so {int8['peak_seqs']} requests ran at once instead of {fp32['peak_seqs']}: x{speedup:.2f} "
        f"the tokens per second, goodput {fp32['goodput']:.0%} -> {int8['goodput']:.0%}"
        if speedup > 1
        else f"yet with {int8['peak_seqs']} requests at once instead of {fp32['peak_seqs']} it made "
        f"x{speedup:.2f} the tokens per second: the larger batch's decode steps "
        f"({int8['tpot_p50_s'] * 1e3:.0f} ms against {fp32['tpot_p50_s'] * 1e3:.0f} ms per token) cost "
        "more than the room bought"
    )
    tail = (
        "the longest prompts now wait their turn"
        if memory["ttft_p99_s"] > fcfs["ttft_p99_s"]
        else "no request paid for it at the tail"
    )
    three = (
        f"(a) Capacity: reserving each request's declared maximum ran {reserve['peak_seqs']} requests "
        f"at once where paging ran {paged['peak_seqs']} on the same bytes. Bandwidth: int8 stores a token in "
        f"{int8['kv_bytes_per_token']:,} B instead of {fp32['kv_bytes_per_token']:,}, "
        f"{fp32['kv_bytes_per_token'] / int8['kv_bytes_per_token']:.1f}x fewer bytes to hold and read "
        f"in the same pool, {speed}. Scheduling: admitting by memory cost (with a host tier to swap to) "
        "instead of by arrival "
        f"moved the median time to first token from {fcfs['ttft_p50_s']:.2f} s "
        f"to {memory['ttft_p50_s']:.2f} s (goodput {fcfs['goodput']:.0%} -> {memory['goodput']:.0%}; "
        f"p99 {fcfs['ttft_p99_s']:.2f} -> {memory['ttft_p99_s']:.2f} s: {tail})."
    )
    rows = old["rows"]
    exact, int8, h2o, window = rows["paged"], rows["int8"], rows["h2o"], rows["window"]
    places = [name for name, value in busy["bytes"].items() if value]
    placed = (
        f"(b) At the busiest step, with {busy['running']} requests running and {busy['waiting']} waiting, "
        f"their KV lay in {len(places)} kinds of place at once ({'; '.join(places)}): no single switch "
        "explains where a byte is; the ladder and the admission policy decided it together."
    )
    reread = (
        f"(c) Reading an old token again is free when it is only paged "
        f"({exact['p_answer']:.3f} for the right answer), "
        f"nearly free in int8 (p {int8['p_answer']:.3f}, KL {int8['kl']:.4f}), and decided by "
        f"what the policy kept once it is evicted: H2O p {h2o['p_answer']:.3f}, a recent window "
        f"p {window['p_answer']:.3f}. An evicted token comes back only by recomputing the prompt "
        f"({old['prefill_seconds'] * 1e3:.0f} ms here), a swapped one by copying it "
        f"({rows['swapped']['remedy_seconds'] * 1e3:.1f} ms): that is why the pressure ladder "
        "swaps before it evicts, and evicts only when allowed."
    )
    return f"{three} {placed} {reread}"


def main() -> None:
    args = lesson_args(__doc__)
    settings = SETTINGS["quick" if args.quick else "default"]
    torch.manual_seed(0)
    model_dir = require_model()
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)
    text_ids = tokenizer.encode(read_text())

    console.rule("(a) Capacity, bandwidth, scheduling: one row of the bench each")
    problems = three_problems(model_dir, settings)
    show_problems(problems)

    console.rule("(b) One busy step: where every byte of KV lives")
    busy = busiest_step(model, tokenizer, text_ids, settings)
    show_busy(busy)

    console.rule("(c) An old token needed again")
    old = old_token(model, tokenizer, text_ids, settings)
    show_old_token(old)

    console.rule("(d) Scheduling on traffic it was not tuned on")
    sched = held_out_scheduling(model_dir, settings)
    show_scheduling(sched)
    plot(problems, busy, old, sched, args.out)

    (reserve, paged), (fp32, int8), (fcfs, memory) = (
        problems[k] for k in ("capacity", "bandwidth", "scheduling")
    )
    numbers = {
        "reserve_peak_seqs": reserve["peak_seqs"],
        "paged_peak_seqs": paged["peak_seqs"],
        "fp32_bytes_per_token": fp32["kv_bytes_per_token"],
        "int8_bytes_per_token": int8["kv_bytes_per_token"],
        "fp32_peak_seqs": fp32["peak_seqs"],
        "int8_peak_seqs": int8["peak_seqs"],
        "fp32_output_tok_s": fp32["output_tok_s"],
        "int8_output_tok_s": int8["output_tok_s"],
        "fcfs_ttft_p50_s": fcfs["ttft_p50_s"],
        "memory_ttft_p50_s": memory["ttft_p50_s"],
        "fcfs_goodput": fcfs["goodput"],
        "memory_goodput": memory["goodput"],
        **{f"busy_{k.split(' (')[0].replace(' ', '_')}_bytes": v for k, v in busy["bytes"].items()},
        "busy_running": busy["running"],
        **{
            f"old_{case}_{key}": value
            for case, row in old["rows"].items()
            for key, value in row.items()
            if key not in ("label", "remedy")
        },
    }
    numbers |= {
        f"sched_{traffic.replace(' ', '_')}_{policy.replace(', ', '_').replace(' ', '_')}_goodput": run[
            "goodput"
        ]
        for (traffic, policy), run in sched["results"].items()
    }
    save_numbers(args.out, "13_memory_system.json", numbers)
    console.print(f"\n[bold]What it means:[/bold] {meaning(problems, busy, old)} {scheduling_meaning(sched)}")


if __name__ == "__main__":
    main()
