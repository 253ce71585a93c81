"""Lesson 14 — speculation and rollback: what a rejected guess costs in KV, and when guessing pays.

Decode at batch 1 reads every weight to make one token. Speculative decoding from the prompt
(`engine/speculative.py`) guesses the next k tokens by finding the last few earlier in the
sequence, and checks the guesses in the same pass as the token before them: k + 1 query rows
instead of 1. Each kept guess is a token that needed no pass of its own; a rejected guess has
already written its K/V into the sequence's blocks, and the KV cache manager cuts them back
(`Rollback.truncate`, `memory/rollback.py`). With the real model:
  1. rollback in KV: one real engine step whose guesses are rejected — the block table before
     the step, with the guesses written, after the truncate; which blocks came back, and that no
     prefix-cache entry covers a rejected token;
  2. the price of a row: one forward pass and its logits through the engine's own runner, with
     1 to k + 1 query rows per sequence, at batch 1 and at batch 16;
  3. when guessing pays: at acceptance rate a per guess, a pass with k guesses gives
     (1 - a^(k+1)) / (1 - a) tokens; from part 2's costs, the acceptance below which it loses;
  4. end to end: a prompt that quotes a passage and open-ended ones, greedy, with and without
     speculation: decode speed, acceptance, tokens per pass, and the same tokens.

    python lessons/14_speculation.py [--quick] [--out DIR]
"""

import re
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from _common import console, lesson_args, require_model, save_numbers, save_plot, table  # noqa: E402

from minillm.attention.kernels import attention_backend  # noqa: E402
from minillm.config import EngineConfig  # noqa: E402
from minillm.engine import LLM, SamplingParams  # noqa: E402
from minillm.engine.runner import ModelRunner  # noqa: E402
from minillm.engine.scheduler import ScheduledSequence  # noqa: E402
from minillm.engine.sequence import Sequence  # noqa: E402
from minillm.evaluation import read_text  # noqa: E402
from minillm.memory import KVCacheManager  # noqa: E402
from minillm.memory.events import Registered, Truncated  # noqa: E402
from minillm.memory.replay import Replayer  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402
from minillm.weights import load_model  # noqa: E402

K = 4  # guesses per pass in parts 1 and 4 (the engine's default num_speculative_tokens)
SPECULATION = {"speculative": "ngram", "num_speculative_tokens": K}  # n-grams: the engine's defaults
DEMO_BLOCK = 4  # part 1's block size: small, so that a step's guesses reach into blocks of their own
SETTINGS = {
    "default": {
        "passage_chars": 1500,
        "demo_tokens": 64,  # part 1 stops at its first rollback that frees a block, by this many at most
        "max_rows": 8,  # part 2: 1 .. k + 1 rows, k up to 7
        "context_1": 256,  # tokens of context of the batch-1 sequence
        "context_16": 256,  # ... of each of the 16
        "repeats": 7,  # timed passes per row count (after one untimed), median
        "new_tokens": 128,  # part 4
        "open_prompts": ["sky", "poem"],
        "runs": 2,  # part 4: each decode this many times, alternating, the fastest kept (shared cores)
    },
    "quick": {
        "passage_chars": 600,
        "demo_tokens": 32,
        "max_rows": 5,
        "context_1": 128,
        "context_16": 16,
        "repeats": 1,
        "new_tokens": 16,
        "open_prompts": ["sky"],
        "runs": 1,
    },
}
OPEN_PROMPTS = {"sky": "Why is the sky blue?", "poem": "Write a short poem about autumn."}
BATCH = 16


def pool_bytes(model, tokens: int, sequences: int = 1) -> int:
    """A KV pool for `tokens` tokens (and a few blocks more per sequence): the engine's default
    512 MiB takes longer to allocate than some of these runs take."""
    return model.config.kv_bytes_per_token(model.dtype) * (tokens + 48 * sequences)


# ---------------------------------------------------------------- 1. rollback in KV
class StepRecorder:
    """Follows the memory system's events, changing nothing (`engine.subscribe`): a `Replayer`
    (`memory/replay.py`) rebuilds every block table from them, and at the sequence's `Truncated`
    (speculation's rollback) the recorder pictures its table as the guesses wrote it and after
    the cut. It also keeps the tokens each prefix-cache entry vouches for (`Registered`)."""

    def __init__(self, engine, seq_id: int):
        self.seq_id, self.replayer = seq_id, Replayer()
        self.vouched: dict[int, tuple[int, ...]] = {}  # block -> the tokens its cache entry stands for
        self.written = self.rolled_back = None
        engine.subscribe(self)

    def __call__(self, step: int, event) -> None:
        cut = isinstance(event, Truncated) and event.seq_id == self.seq_id
        if cut:
            self.written = self.picture()
        self.replayer.apply(event)
        if cut:
            self.rolled_back = self.picture()
        if isinstance(event, Registered):
            self.vouched[event.block] = event.tokens

    def cached_tokens(self, block: int) -> tuple[int, ...] | None:
        """The tokens the prefix cache vouches for in `block`, or None if it vouches for none."""
        return self.vouched.get(block) if block in self.replayer.cached else None

    def picture(self) -> dict:
        """The sequence's block table, which of its blocks the prefix cache vouches for, free blocks
        (a block is free iff no table holds it), all as the events tell it."""
        replayer = self.replayer
        table = list(replayer.tables.get(self.seq_id, []))
        held = sum(replayer.tier(block) == "device" for block in replayer.refcounts)
        return {
            "table": table,
            "cached": {block for block in table if block in replayer.cached},
            "free": replayer.num_blocks - held,
        }


def rollback_step(model, tokenizer, prompt: list[int], max_tokens: int) -> dict:
    """Decode `prompt` with speculation and the prefix cache on, step by step, until a step's
    guesses are rejected and its rollback frees a block; what the step did to the block table."""
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        block_size=DEMO_BLOCK,
        prefix_caching=True,
        kv_cache_bytes=pool_bytes(model, len(prompt) + max_tokens),
        **SPECULATION,
    )
    engine = llm.engine
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    seq = engine.requests[request_id][0]
    recorder = StepRecorder(engine, seq.seq_id)
    found = None
    while engine.has_unfinished_requests() and found is None:
        found = watched_step(engine, seq, recorder)
    if found is None:
        raise RuntimeError(f"no rejected guess freed a block in {max_tokens} tokens; raise demo_tokens")
    found |= {
        "freed_are_free": not any(recorder.replayer.refcounts[block] for block in found["freed"]),
        "kept_entries": found["entries_before"] + 1 + found["kept"],
        "stale_entries": stale_entries(recorder, found),
        "kv_bytes_per_token": model.config.kv_bytes_per_token(model.dtype),
    }
    engine.abort(request_id)
    found["probe_hit_tokens"] = probe_hit_tokens(engine, found)
    return found


def watched_step(engine, seq, recorder: StepRecorder) -> dict | None:
    """One engine step; what it did to `seq`'s blocks if it rejected guesses and its rollback
    freed a block, else None."""
    before = recorder.picture() if seq.output_ids else None
    entries_before, num_outputs = seq.num_cached, len(seq.output_ids)
    recorder.written = None
    engine.step()
    guesses = engine.checked_guesses().get(seq.seq_id, [])
    if recorder.written is None or seq.finish_reason:  # no guesses cut back this step, or it ended
        return None
    kept = len(seq.output_ids) - num_outputs - 1  # guesses kept; the last token appended is the model's
    freed = [b for b in recorder.written["table"] if b not in recorder.rolled_back["table"]]
    if kept == len(guesses) or not freed:
        return None
    return {
        "before": before,
        "written": recorder.written,
        "rolled_back": recorder.rolled_back,
        "after": recorder.picture(),
        "entries_before": entries_before,
        "guesses": guesses,
        "kept": kept,
        "model_token": seq.output_ids[num_outputs + kept],
        "freed": freed,
        "token_ids": list(seq.token_ids),
        "num_computed": seq.num_computed,
    }


def probe_hit_tokens(engine, step: dict) -> int:
    """What the prefix cache hands a later prompt made of the kept tokens and then the rejected
    guesses: the prompt tokens its first lookup found cached."""
    kept = step["kept_entries"]
    probe = step["token_ids"][:kept] + step["guesses"][step["kept"] :] + [0]
    hits_before = engine.prefix_hit_tokens()
    engine.add_request(probe, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.prefix_hit_tokens() - hits_before


def stale_entries(recorder: StepRecorder, step: dict) -> int:
    """Prefix-cache entries that vouch for anything but the sequence's computed tokens after the
    step: one on a block the rollback freed (it held only rejected guesses), or on a block of its
    table whose tokens are not the sequence's there or not all computed."""
    stale = sum(recorder.cached_tokens(block) is not None for block in step["freed"])
    for index, block in enumerate(step["after"]["table"]):
        tokens = recorder.cached_tokens(block)
        span = slice(index * DEMO_BLOCK, (index + 1) * DEMO_BLOCK)
        if tokens and (tokens != tuple(step["token_ids"][span]) or span.stop > step["num_computed"]):
            stale += 1
    return stale


def show_rollback(step: dict, tokenizer) -> None:
    hidden = max(0, len(step["before"]["table"]) - 2)  # the blocks no step of this one touches

    def cells(picture):
        shown = [f"[{b}]{'=' if b in picture['cached'] else ' '}" for b in picture["table"][hidden:]]
        return f"({hidden} more) " + " ".join(shown)

    guesses, kept = step["guesses"], step["kept"]
    written = step["entries_before"] + 1 + len(guesses)
    rows = [
        ["before the step", step["entries_before"], cells(step["before"]), step["before"]["free"]],
        [f"{len(guesses)} guesses written", written, cells(step["written"]), step["written"]["free"]],
        [
            f"rolled back ({kept} kept)",
            step["kept_entries"],
            cells(step["rolled_back"]),
            step["rolled_back"]["free"],
        ],
        ["after the step", step["kept_entries"], cells(step["after"]), step["after"]["free"]],
    ]
    table(
        f"one step of one sequence, {DEMO_BLOCK}-token blocks, prefix cache on",
        ["moment", "KV entries", "block table's end; [n]= cached", "free blocks"],
        rows,
    )
    shown = " ".join(
        f"{tokenizer.decode([t])!r}{' kept' if i < kept else ' rejected'}" for i, t in enumerate(guesses)
    )
    rejected = len(guesses) - kept
    console.print(
        f"guesses: {shown}; the model chose {tokenizer.decode([step['model_token']])!r} "
        f"at guess {kept + 1}.\n"
        f"blocks {step['freed']} came back to the free pool (free again: {step['freed_are_free']}); "
        f"{rejected} rejected entries x {step['kv_bytes_per_token']:,} B = "
        f"{rejected * step['kv_bytes_per_token']:,} B of K/V written in vain.\n"
        f"prefix-cache entries on a rejected token: {step['stale_entries']}; a new prompt of the kept "
        f"tokens then the rejected guesses finds {step['probe_hit_tokens']} tokens cached "
        f"(the kept tokens fill {step['kept_entries'] // DEMO_BLOCK * DEMO_BLOCK})"
    )


# ---------------------------------------------------------------- 2. the price of a row
def resident(model, contexts: list[list[int]], max_rows: int):
    """The parts an engine assembles for one forward pass, built here as the engine builds them: a
    KV cache manager and a model runner over it. Each sequence has prefilled its context but its
    last token (one pass), and holds blocks for `max_rows` rows from there, as the scheduler
    reserves them for a decoding sequence's guesses."""
    kv_bytes = pool_bytes(model, sum(len(context) + max_rows + 8 for context in contexts), len(contexts))
    config = EngineConfig(kv_cache_bytes=kv_bytes, dtype=str(model.dtype).removeprefix("torch."))
    kv_cache = KVCacheManager.build(config, model.config, model.dtype, model.device)
    runner = ModelRunner(model, kv_cache, attention_backend(config))
    params = SamplingParams(max_tokens=max_rows + 8, ignore_eos=True)
    seqs = [
        Sequence(i, str(i), context, params, len(context) + max_rows + 8)
        for i, context in enumerate(contexts)
    ]
    prefill = []
    for seq in seqs:
        grant = kv_cache.allocate(seq.seq_id, seq.token_ids, 0, 0, seq.num_tokens - 1)
        prefill.append(ScheduledSequence(seq, grant.num_tokens))
    runner.forward(prefill)
    for seq in seqs:
        seq.num_computed = seq.num_tokens - 1
        tokens = seq.token_ids + seq.prompt_ids[: max_rows - 1]  # any guesses: their values cost nothing
        grant = kv_cache.allocate(seq.seq_id, tokens, seq.num_computed, seq.num_cached, max_rows)
        assert grant.num_tokens == max_rows
    return runner, seqs


@torch.inference_mode()
def pass_seconds(runner, seqs, rows: int) -> float:
    """One pass as a step with guesses runs it: each sequence's last token and rows - 1 guesses,
    laid end to end (`ModelRunner.forward`; one row is a decode query, more are a small prefill
    chunk, as in a real step), then the logits of each of those rows. Nothing is kept
    (num_computed does not move): the next pass writes the same slots again."""
    scheduled = [ScheduledSequence(seq, rows, seq.prompt_ids[: rows - 1]) for seq in seqs]
    start = time.perf_counter()
    forward = runner.forward(scheduled)
    checked = [row for last in forward.last_rows for row in range(last - rows + 1, last + 1)]
    runner.logits(forward.hidden, checked)  # (len(seqs) * rows, vocab)
    return time.perf_counter() - start


@torch.inference_mode()
def head_seconds(model, rows: int) -> float:
    """The output projection alone (`model.logits`, the tied 49,152 x 576 embedding) on `rows` rows."""
    hidden = torch.randn(rows, model.config.hidden_size, dtype=model.dtype)  # (rows, hidden)
    start = time.perf_counter()
    model.logits(hidden)  # (rows, vocab)
    return time.perf_counter() - start


def median_by_rows(measure, max_rows: int, repeats: int) -> list[float]:
    """Median seconds of `measure(rows)` for rows 1..max_rows: one untimed round, then `repeats`
    rounds over every row count (interleaved, so that a drift in the machine hits all alike)."""
    for rows in range(1, max_rows + 1):
        measure(rows)
    times = {rows: [] for rows in range(1, max_rows + 1)}
    for _ in range(repeats):
        for rows in times:
            times[rows].append(measure(rows))
    return [statistics.median(times[rows]) for rows in times]


def price_of_rows(model, text_ids: list[int], settings: dict) -> dict:
    max_rows, repeats = settings["max_rows"], settings["repeats"]
    costs = {}
    for batch, context in ((1, settings["context_1"]), (BATCH, settings["context_16"])):
        contexts = [text_ids[i * context : (i + 1) * context] for i in range(batch)]
        runner, seqs = resident(model, contexts, max_rows)
        costs[batch] = median_by_rows(lambda rows: pass_seconds(runner, seqs, rows), max_rows, repeats)
    head = median_by_rows(lambda rows: head_seconds(model, rows), max_rows, repeats)
    return {
        "seconds": costs,
        "head_seconds": head,
        "contexts": (settings["context_1"], settings["context_16"]),
    }


def show_rows(price: dict) -> None:
    one, many, head = price["seconds"][1], price["seconds"][BATCH], price["head_seconds"]
    rows = [
        [
            r + 1,
            f"{one[r] * 1e3:.1f}",
            f"{one[r] / one[0]:.2f}x",
            f"{head[r] * 1e3:.1f}",
            f"{head[r] / head[0]:.2f}x",
            f"{many[r] * 1e3:.1f}",
            f"{many[r] / many[0]:.2f}x",
        ]
        for r in range(len(one))
    ]
    context_1, context_16 = price["contexts"]
    table(
        f"one pass and its logits, median; batch 1 at {context_1} tokens of context, "
        f"batch {BATCH} at {context_16} each ({torch.get_num_threads()} threads)",
        ["rows", "batch 1 ms", "/ 1 row", "head ms", "/ 1 row", f"batch {BATCH} ms", "/ 1 row"],
        rows,
    )
    console.print(
        "rows: query rows per sequence (its last token and rows - 1 guesses); head: the output "
        "projection alone (`model.logits`, 49,152 x 576 weights) on that many rows"
    )


# ---------------------------------------------------------------- 3. when guessing pays
def tokens_per_pass(acceptance: float, k: int) -> float:
    """Expected tokens a pass with k guesses gives, each kept with probability `acceptance` while
    all before it were: the kept run, then the model's own token."""
    if acceptance >= 1:
        return k + 1
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def break_even(cost_ratio: float, k: int) -> float | None:
    """The acceptance rate at which k guesses give as many tokens per pass as the pass costs, in
    plain passes; None where even always-right guesses do not pay (cost_ratio >= k + 1)."""
    if cost_ratio <= 1:
        return 0.0
    if cost_ratio >= k + 1:
        return None
    low, high = 0.0, 1.0  # tokens_per_pass grows with the acceptance rate: bisect
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if tokens_per_pass(middle, k) < cost_ratio else (low, middle)
    return (low + high) / 2


def break_evens(price: dict) -> dict[int, list]:
    """Per batch, the break-even acceptance of k = 1 .. max_rows - 1 guesses."""
    return {
        batch: [break_even(seconds[k] / seconds[0], k) for k in range(1, len(seconds))]
        for batch, seconds in price["seconds"].items()
    }


def shown_rate(rate: float | None) -> str:
    return "never" if rate is None else f"{rate:.2f}"


def show_break_even(price: dict, evens: dict) -> None:
    one, many = price["seconds"][1], price["seconds"][BATCH]
    rows = [
        [
            k,
            f"{tokens_per_pass(0.8, k):.2f}",
            f"{one[k] / one[0]:.2f}x",
            shown_rate(evens[1][k - 1]),
            f"{many[k] / many[0]:.2f}x",
            shown_rate(evens[BATCH][k - 1]),
        ]
        for k in range(1, len(one))
    ]
    table(
        "guessing pays when (1 - a^(k+1)) / (1 - a) tokens per pass beat the pass's price",
        ["k", "tokens at a=0.8", "batch 1 price", "pays above a", f"batch {BATCH} price", "pays above a"],
        rows,
    )
    console.print(
        "k: guesses per pass; tokens at a=0.8: what a pass gives when each guess is kept with "
        "probability 0.8; price: the pass over k + 1 rows, in 1-row passes (part 2)"
    )


# ---------------------------------------------------------------- 4. end to end
def quote_prompt(tokenizer, chars: int, as_printed: bool) -> list[int]:
    """The first `chars` of Alice's first chapter, then its first line again as plain text to
    continue: the model quotes the rest (input-grounded). `as_printed` keeps the typewritten text's
    double spaces and indents, which this model does not copy: it writes one space where the
    passage has two, so the guess of the second space is rejected (part 1's example); without
    them it copies on."""
    text = read_text()
    start = text.index("Alice was beginning")
    passage = text[start : start + chars]
    if not as_printed:
        passage = re.sub(r"(?<=\S)  +", " ", passage).replace("\n  ", "\n")
    again = "Here is a passage.\n\n" + passage + "\n\nThe same passage again, word for word:\n\n"
    return tokenizer.encode(again + passage[: passage.index("\n") + 1])


def prompts(tokenizer, settings: dict) -> dict[str, list[int]]:
    """The quote (double spaces collapsed), and the open questions in the chat template."""
    chosen = {"quote": quote_prompt(tokenizer, settings["passage_chars"], as_printed=False)}
    for name in settings["open_prompts"]:
        chosen[name] = tokenizer.encode_chat([{"role": "user", "content": OPEN_PROMPTS[name]}])
    return chosen


def decode(model, tokenizer, prompt: list[int], new_tokens: int, speculative: bool) -> dict:
    """Greedy decoding of one prompt; decode time and passes counted from the first token on (the
    prefill apart)."""
    switches = SPECULATION if speculative else {}
    kv_cache_bytes = pool_bytes(model, len(prompt) + new_tokens)
    llm = LLM(model=model, tokenizer=tokenizer, kv_cache_bytes=kv_cache_bytes, **switches)
    engine = llm.engine
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=new_tokens))
    seq = engine.requests[request_id][0]
    while not seq.output_ids:  # the prefill, and the first token
        engine.step()
    passes, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        passes += 1
    seconds = time.perf_counter() - start
    return {
        "tokens": list(seq.output_ids),
        "tok_s": (len(seq.output_ids) - 1) / seconds if len(seq.output_ids) > 1 else 0.0,
        "passes": passes,
        "finish_reason": seq.finish_reason,
        "error": seq.error,
        **engine.stats.speculation(),
    }


def end_to_end(model, tokenizer, settings: dict) -> dict[str, dict]:
    """Each prompt decoded without and with guessing, `runs` times each, alternating; the fastest
    run of each kept (every run gives the same tokens and counts, only the clock differs)."""
    results = {}
    for name, prompt in prompts(tokenizer, settings).items():
        runs = [
            (
                decode(model, tokenizer, prompt, settings["new_tokens"], speculative=False),
                decode(model, tokenizer, prompt, settings["new_tokens"], speculative=True),
            )
            for _ in range(settings["runs"])
        ]
        plain = max((run[0] for run in runs), key=lambda r: r["tok_s"])
        guessed = max((run[1] for run in runs), key=lambda r: r["tok_s"])
        results[name] = {
            "plain": plain,
            "speculative": guessed,
            "identical": all(a["tokens"] == b["tokens"] == plain["tokens"] for a, b in runs),
            "speedup": guessed["tok_s"] / plain["tok_s"] if plain["tok_s"] else 0.0,
            "text": tokenizer.decode(guessed["tokens"]),
        }
    return results


def predicted_speedup(guessed: dict, price: list[float]) -> float:
    """The speed-up part 2's batch-1 price gives this run's passes: a pass without guesses costs
    1, a guessing pass the price of its rows (its last token and its mean number of guesses),
    against one plain pass per token."""
    if not guessed["drafts"]:
        return 1.0
    rows = min(round(1 + guessed["draft_tokens"] / guessed["drafts"]), len(price))
    cost = guessed["passes"] - guessed["drafts"] + guessed["drafts"] * price[rows - 1] / price[0]
    return (len(guessed["tokens"]) - 1) / cost


def show_end_to_end(results: dict, price: dict, new_tokens: int) -> None:
    rows = [
        [
            name,
            f"{r['plain']['tok_s']:.1f}",
            f"{r['speculative']['tok_s']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{predicted_speedup(r['speculative'], price['seconds'][1]):.2f}x",
            f"{r['speculative']['drafts']}/{r['speculative']['passes']}",
            f"{r['speculative']['acceptance_rate']:.2f}",
            f"{r['speculative']['tokens_per_pass']:.2f}",
            "yes" if r["identical"] else "NO",
        ]
        for name, r in results.items()
    ]
    table(
        f"greedy, batch 1, k = {K}, up to {new_tokens} tokens; decode only (after the first token)",
        ["prompt", "tok/s", "guessing", "speed-up", "predicted", "guessed", "kept", "per pass", "same"],
        rows,
    )
    console.print(
        "tok/s without and with guessing; predicted: the passes below priced by part 2 (batch 1); "
        "guessed: passes that guessed / all passes; kept: the acceptance rate; per pass: tokens a "
        "guessing pass gave; same: identical tokens"
    )
    for name, r in results.items():
        ended = f"{r['plain']['finish_reason']} / {r['speculative']['finish_reason']}"
        console.print(f"{name} (ended by {ended}): {r['text'][:90]!r}")
        if r["speculative"]["error"]:
            console.print(f"  [red]the guessing run ended with an error:[/red] {r['speculative']['error']}")


# ---------------------------------------------------------------- plot, numbers, meaning
def plot(price: dict, evens: dict, results: dict, out_dir) -> None:
    fig, (ax_rows, ax_even, ax_speed) = plt.subplots(1, 3, figsize=(16, 4.4))
    rows = list(range(1, len(price["seconds"][1]) + 1))
    plot_rows(ax_rows, price, rows)
    plot_break_even(ax_even, evens, results, rows[:-1])  # k guesses: k + 1 rows
    plot_end_to_end(ax_speed, results)
    fig.tight_layout()
    save_plot(fig, out_dir, "14_speculation.png")


def plot_rows(ax, price: dict, rows: list[int]) -> None:
    for batch, seconds in price["seconds"].items():
        ax.plot(rows, [s / seconds[0] for s in seconds], marker="o", label=f"batch {batch}")
    ax.plot(
        rows,
        [s / price["head_seconds"][0] for s in price["head_seconds"]],
        marker=".",
        linestyle=":",
        label="output projection alone",
    )
    ax.plot(rows, rows, linestyle="--", color="grey", label="every row full price")
    ax.axhline(1, color="grey", linewidth=0.8)
    ax.set(
        xlabel="query rows per sequence (k + 1)",
        ylabel="pass time / 1-row pass",
        title="2. The price of a row",
        xticks=rows,
    )
    ax.legend(fontsize=8)


def plot_break_even(ax, evens: dict, results: dict, ks: list[int]) -> None:
    for batch, marker in ((1, "o"), (BATCH, "s")):
        ax.plot(
            ks,
            [1.05 if rate is None else rate for rate in evens[batch]],
            marker=marker,
            label=f"break-even, batch {batch}",
        )
    guessing = [(name, r) for name, r in results.items() if r["speculative"]["drafts"]]
    for (name, r), color in zip(guessing, ("#2ca02c", "#d62728", "#9467bd")):
        ax.axhline(
            r["speculative"]["acceptance_rate"], color=color, linestyle="--", label=f"measured: {name[:24]}"
        )
    ax.set(
        xlabel="k guesses",
        ylabel="acceptance rate",
        ylim=(0, 1.1),
        title="3. Guessing pays above the line (1.05: never)",
        xticks=ks,
    )
    ax.legend(fontsize=7)


def plot_end_to_end(ax, results: dict) -> None:
    names = list(results)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [results[n]["plain"]["tok_s"] for n in names], 0.4, label="plain")
    ax.bar(
        [i + 0.2 for i in x],
        [results[n]["speculative"]["tok_s"] for n in names],
        0.4,
        label=f"guessing, k = {K}",
    )
    ax.set_xticks(list(x), [n[:22] for n in names], fontsize=8)
    same = "same tokens" if all(r["identical"] for r in results.values()) else "TOKENS DIFFER"
    ax.set(ylabel="decode tokens/s, batch 1", title=f"4. End to end ({same})")
    ax.legend(fontsize=8)


def numbers_of(step: dict, price: dict, evens: dict, results: dict) -> dict:
    one, many = price["seconds"][1], price["seconds"][BATCH]
    numbers = {
        "rollback_guesses": len(step["guesses"]),
        "rollback_kept": step["kept"],
        "rollback_blocks_freed": len(step["freed"]),
        "rollback_freed_blocks_free": step["freed_are_free"],
        "rollback_stale_prefix_entries": step["stale_entries"],
        "rollback_probe_hit_tokens": step["probe_hit_tokens"],
        "rollback_kept_entries": step["kept_entries"],
        "threads": torch.get_num_threads(),
        "pass_ms_batch_1": [s * 1e3 for s in one],
        "pass_ms_batch_16": [s * 1e3 for s in many],
        "row_price_batch_1": [s / one[0] for s in one],
        "row_price_batch_16": [s / many[0] for s in many],
        "output_projection_price": [s / price["head_seconds"][0] for s in price["head_seconds"]],
        "break_even_batch_1": evens[1],
        "break_even_batch_16": evens[BATCH],
    }
    for name, r in results.items():
        guessed = r["speculative"]
        numbers |= {
            f"{name}_identical": r["identical"],
            f"{name}_tokens": len(guessed["tokens"]),
            f"{name}_acceptance": guessed["acceptance_rate"],
            f"{name}_tokens_per_pass": guessed["tokens_per_pass"],
            f"{name}_drafts": guessed["drafts"],
            f"{name}_plain_tok_s": r["plain"]["tok_s"],
            f"{name}_speculative_tok_s": guessed["tok_s"],
            f"{name}_speedup": r["speedup"],
            f"{name}_predicted_speedup": predicted_speedup(guessed, one),
            f"{name}_passes": guessed["passes"],
            f"{name}_finish_reason": guessed["finish_reason"],
        }
    return numbers


def meaning(step: dict, price: dict, evens: dict, results: dict) -> str:
    return f"{meaning_of_costs(step, price, evens)} {meaning_end_to_end(results, price['seconds'][1])}"


def meaning_of_costs(step: dict, price: dict, evens: dict) -> str:
    """Parts 1 to 3: what a rejected guess costs in KV, what a row costs, where guessing pays."""
    one, many, head = price["seconds"][1], price["seconds"][BATCH], price["head_seconds"]
    k = min(K, len(one) - 1)
    rejected = len(step["guesses"]) - step["kept"]
    kv = (
        f"(1) A rejected guess costs its row of the pass and the K/V it wrote ({rejected} entries, "
        f"{rejected * step['kv_bytes_per_token']:,} B in part 1) and holds blocks for one step only: "
        f"the truncate gave {len(step['freed'])} back, and because blocks are registered after the "
        f"rollback, the prefix cache held {step['stale_entries']} entries on a rejected token."
    )
    jump = next((r for r in range(1, len(head)) if head[r] / head[0] > 1.5), None)
    steps = (
        f"the output projection alone costs the same up to {jump} rows and {head[jump] / head[0]:.1f}x at "
        f"{jump + 1}: this CPU's fp32 product is paid in tiles of rows"
        if jump
        else f"the output projection alone costs {head[-1] / head[0]:.2f}x at {len(head)} rows"
    )
    price_16 = "not free" if many[1] / many[0] > 1.15 else "nearly free"
    rows = (
        f"(2) At batch 1 a second row cost {one[1] / one[0]:.2f}x and {k + 1} rows {one[k] / one[0]:.2f}x "
        f"({steps}); at batch {BATCH}, where every pass already has {BATCH} rows, rows were {price_16}: "
        f"{many[1] / many[0]:.2f}x and {many[k] / many[0]:.2f}x. (3) So {k} guesses pay only above an "
        f"acceptance rate of {shown_rate(evens[1][k - 1])} at batch 1 and {shown_rate(evens[BATCH][k - 1])} "
        f"at batch {BATCH}."
    )
    return f"{kv} {rows}"


def verdict(name: str, r: dict, price: list[float]) -> str:
    """How guessing went for one prompt of part 4, against what part 2's batch-1 `price` predicts."""
    guessed, prompt = r["speculative"], OPEN_PROMPTS.get(name, "quoting the passage")
    if not guessed["drafts"]:
        return f"{prompt!r} never guessed, so its {r['speedup']:.2f}x is the clock's noise"
    outcome = "paid" if r["speedup"] > 1.1 else "lost" if r["speedup"] < 0.9 else "about broke even"
    return (
        f"{prompt!r} guessed in {guessed['drafts']} of {guessed['passes']} passes, kept "
        f"{guessed['acceptance_rate']:.2f} of the guesses, and {outcome}: {r['speedup']:.2f}x "
        f"(part 2's price predicts {predicted_speedup(guessed, price):.2f}x)"
    )


def meaning_end_to_end(results: dict, price: list[float]) -> str:
    """Part 4: where guessing paid, and how real guesses differ from the formula's."""
    parts = [verdict(name, r, price) for name, r in results.items()]
    same = (
        "the same tokens each time" if all(r["identical"] for r in results.values()) else "DIFFERENT TOKENS"
    )
    rates = [r["speculative"] for r in results.values() if 0 < r["speculative"]["acceptance_rate"] < 0.95]
    runs = ""
    if rates:  # the formula assumes each guess is kept independently; real guesses come right in runs
        low = min(rates, key=lambda guessed: guessed["acceptance_rate"])
        runs = (
            f" At acceptance {low['acceptance_rate']:.2f} the formula expects "
            f"{tokens_per_pass(low['acceptance_rate'], K):.2f} tokens a pass, the engine got "
            f"{low['tokens_per_pass']:.2f}: guesses are right or wrong in runs, not one by one."
        )
    failed = [name for name, r in results.items() if r["speculative"]["finish_reason"] == "error"]
    if failed:  # the tokens are all there; the engine failed the step that ended the request
        runs += (
            f" The guessing runs of {', '.join(failed)} ended with an error in the step that finished "
            "them (their tokens are complete): an engine bug, not a cost of guessing."
        )
    ends = (
        f"(4) Greedy, with {same}: " + "; ".join(parts) + f".{runs} Guessing pays where the output "
        "repeats its input (or itself), as far as a pass's extra rows stay cheap; a sequence guesses "
        "only as far as its recent acceptance pays for the rows at the engine's measured price, so "
        "where guesses fail it soon stops and loses little."
    )
    return ends


def main() -> None:
    args = lesson_args(__doc__)
    settings = SETTINGS["quick" if args.quick else "default"]
    torch.manual_seed(0)
    model_dir = require_model()
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)  # float32
    text_ids = tokenizer.encode(read_text())
    as_printed = quote_prompt(tokenizer, settings["passage_chars"], as_printed=True)

    console.rule("1. Rollback in KV: one step whose guesses are rejected")
    step = rollback_step(model, tokenizer, as_printed, settings["demo_tokens"])
    show_rollback(step, tokenizer)

    console.rule("2. The price of a row: one pass over 1 .. k + 1 query rows per sequence")
    price = price_of_rows(model, text_ids, settings)
    show_rows(price)

    console.rule("3. When guessing pays: the break-even acceptance rate")
    evens = break_evens(price)
    show_break_even(price, evens)

    console.rule("4. End to end: a passage quoted, and open questions")
    results = end_to_end(model, tokenizer, settings)
    show_end_to_end(results, price, settings["new_tokens"])

    plot(price, evens, results, args.out)
    save_numbers(args.out, "14_speculation.json", numbers_of(step, price, evens, results))
    console.print(f"\n[bold]What it means:[/bold] {meaning(step, price, evens, results)}")


if __name__ == "__main__":
    main()
