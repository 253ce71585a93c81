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
  2. end to end (`bench speculative`'s own runs): a prompt that quotes a passage and open-ended
     ones, greedy, with and without speculation, alone and 16 at once: decode speed, acceptance,
     tokens per pass, and the same tokens;
  3. the price of a row: the engine times every decode pass it runs and fits seconds = fixed +
     per_row x rows (`PassCost`, what it decides how far to guess by), read after part 2's runs
     at batch 1 and at batch 16;
  4. when guessing pays: at acceptance rate a per guess, a pass with k guesses gives
     (1 - a^(k+1)) / (1 - a) tokens; from part 3's price, the acceptance below which it loses.

    python lessons/14_speculation.py [--quick] [--out DIR]
"""

import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from _common import console, lesson_args, require_model, save_numbers, save_plot, table  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

from minillm.benchmarks.speculative import batched, counted, decode_rate  # noqa: E402
from minillm.benchmarks.workload import pool_bytes  # noqa: E402
from minillm.engine import LLM, SamplingParams  # noqa: E402
from minillm.evaluation import read_text  # noqa: E402
from minillm.memory.events import Registered, Truncated  # noqa: E402
from minillm.memory.replay import Replayer  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402
from minillm.weights import load_model  # noqa: E402

K = 4  # guesses per pass (the engine's default num_speculative_tokens)
SPECULATION = {"speculative": "ngram", "num_speculative_tokens": K}  # n-grams: the engine's defaults
DEMO_BLOCK = 4  # part 1's block size: small, so that a step's guesses reach into blocks of their own
SETTINGS = {
    "default": {
        "passage_chars": 1500,
        "demo_tokens": 64,  # part 1 stops at its first rollback that frees a block, by this many at most
        "new_tokens": 128,  # part 2
        "open_prompts": ["sky", "poem"],
        "runs": 1,  # part 2: each decode this many times, alternating, the fastest kept (2: steadier, slower)
        "batch_tokens": 48,  # part 2: tokens each of the BATCH requests at once decodes
        "max_rows": 8,  # parts 3 and 4: 1 .. k + 1 rows, k up to 7
    },
    "quick": {
        "passage_chars": 600,
        "demo_tokens": 32,
        "new_tokens": 16,
        "open_prompts": ["sky"],
        "runs": 1,
        "batch_tokens": 16,
        "max_rows": 5,
    },
}
OPEN_PROMPTS = {"sky": "Why is the sky blue?", "poem": "Write a short poem about autumn."}
BATCH = 16


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
        kv_cache_bytes=pool_bytes(model, len(prompt) + max_tokens + 48),  # and the probe's guesses
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


# ---------------------------------------------------------------- 2. end to end
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


def decode(llm, prompt: list[int], new_tokens: int) -> dict:
    """Greedy decoding of one prompt alone (`bench speculative`'s `decode_rate`, from the first
    token on: the prefill apart) and the speculation counters it moved. A pass gives one token
    and the guesses it kept, so the passes are the tokens after the first less the kept guesses."""
    (tok_s, out), guessing = counted(
        llm, lambda: decode_rate(llm, prompt, SamplingParams(max_tokens=new_tokens))
    )
    passes = len(out.token_ids) - 1 - guessing["accepted_tokens"]
    return {
        "tokens": out.token_ids,
        "tok_s": tok_s,
        "passes": passes,
        "finish_reason": out.finish_reason,
        "error": out.error,
        **guessing,
    }


def end_to_end(model, tokenizer, settings: dict) -> tuple[dict, dict, dict]:
    """Each prompt alone without and with guessing, `runs` times each, alternating, the fastest run
    of each kept (every run gives the same tokens and counts, only the clock differs); then BATCH of
    them at once (`bench speculative`'s `batched`). The guessing engine's fitted pass price is read
    after each: (fixed, per_row) seconds, or None where it saw passes of one size only."""
    chosen = prompts(tokenizer, settings)
    longest = max(map(len, chosen.values())) + settings["new_tokens"] + 2 * K + 16  # + a block's rounding
    plain, guessing = (
        LLM(model=model, tokenizer=tokenizer, kv_cache_bytes=pool_bytes(model, BATCH * longest), **switches)
        for switches in ({}, SPECULATION)
    )
    for llm in (plain, guessing):  # warm-up: a first pass pays one-off costs
        llm.generate([chosen["quote"][:32]], SamplingParams(max_tokens=4))
    alone = {}
    for name in reversed(chosen):  # the quote last: the price read after it was fitted on its guesses
        runs = [
            (
                decode(plain, chosen[name], settings["new_tokens"]),
                decode(guessing, chosen[name], settings["new_tokens"]),
            )
            for _ in range(settings["runs"])
        ]
        fastest_plain, fastest_guessing = (max(side, key=lambda r: r["tok_s"]) for side in zip(*runs))
        alone[name] = {
            "plain": fastest_plain,
            "speculative": fastest_guessing,
            "identical": all(a["tokens"] == b["tokens"] == fastest_plain["tokens"] for a, b in runs),
            "speedup": fastest_guessing["tok_s"] / fastest_plain["tok_s"] if fastest_plain["tok_s"] else 0.0,
            "text": tokenizer.decode(fastest_guessing["tokens"]),
        }
    fits = {1: guessing.engine.proposer.cost.fit()}
    params = SamplingParams(max_tokens=settings["batch_tokens"])
    together, counts = counted(
        guessing, lambda: batched(plain, guessing, list(chosen.values()), params, BATCH, 1)
    )
    fits[BATCH] = guessing.engine.proposer.cost.fit()
    return alone, {**together, **counts}, fits


def predicted_speedup(guessed: dict, price: list[float]) -> float:
    """The speed-up part 3's batch-1 price gives this run's passes: a pass without guesses costs
    1, a guessing pass the price of its rows (its last token and its mean number of guesses),
    against one plain pass per token."""
    if not guessed["drafts"]:
        return 1.0
    rows = min(round(1 + guessed["draft_tokens"] / guessed["drafts"]), len(price))
    cost = guessed["passes"] - guessed["drafts"] + guessed["drafts"] * price[rows - 1]
    return (len(guessed["tokens"]) - 1) / cost


def show_end_to_end(results: dict, together: dict, new_tokens: int) -> None:
    rows = [
        [
            name,
            f"{r['plain']['tok_s']:.1f}",
            f"{r['speculative']['tok_s']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['speculative']['drafts']}/{r['speculative']['passes']}",
            f"{r['speculative']['acceptance_rate']:.2f}",
            f"{r['speculative']['tokens_per_pass']:.2f}",
            "yes" if r["identical"] else "NO",
        ]
        for name, r in results.items()
    ]
    rows.append(
        [
            f"all {BATCH} at once",
            f"{together['plain_s']:.1f} s",
            f"{together['ngram_s']:.1f} s",
            f"{together['speedup']:.2f}x",
            f"{together['drafts']} passes",
            f"{together['acceptance_rate']:.2f}",
            f"{together['tokens_per_pass']:.2f}",
            "yes" if together["identical"] else "NO",
        ]
    )
    table(
        f"greedy, k = {K}, up to {new_tokens} tokens alone (decode only, after the first token), "
        f"{together['output_tokens']} at once",
        ["prompt", "tok/s", "guessing", "speed-up", "guessed", "kept", "per pass", "same"],
        rows,
    )
    console.print(
        "tok/s without and with guessing (at once: the whole batch's seconds); guessed: passes that "
        "guessed / all passes; kept: the acceptance rate; per pass: tokens a guessing pass gave"
    )
    for name, r in results.items():
        ended = f"{r['plain']['finish_reason']} / {r['speculative']['finish_reason']}"
        console.print(f"{name} (ended by {ended}): {r['text'][:90]!r}")
        if r["speculative"]["error"]:
            console.print(f"  [red]the guessing run ended with an error:[/red] {r['speculative']['error']}")


# ---------------------------------------------------------------- 3. the price of a row
def price_of_rows(fits: dict, max_rows: int) -> dict[int, list[float] | None]:
    """Per batch, a pass with 1 .. max_rows query rows per sequence in 1-row passes, from the
    engine's fit: (fixed + per_row x batch x rows) / (fixed + per_row x batch)."""
    return {
        batch: None
        if fit is None
        else [(fit[0] + fit[1] * batch * rows) / (fit[0] + fit[1] * batch) for rows in range(1, max_rows + 1)]
        for batch, fit in fits.items()
    }


def show_rows(fits: dict, prices: dict) -> None:
    rows = [
        [
            f"batch {batch}",
            *(
                ["(passes of one size only)"] + [""] * 3
                if fit is None
                else [
                    f"{fit[0] * 1e3:.1f}",
                    f"{fit[1] * 1e3:.2f}",
                    f"{prices[batch][1]:.2f}x",
                    f"{prices[batch][K]:.2f}x",
                ]
            ),
        ]
        for batch, fit in fits.items()
    ]
    table(
        f"the engine's own price of a pass, fitted to its decode passes ({torch.get_num_threads()} threads)",
        ["", "fixed ms", "per row ms", "2 rows / 1", f"{K + 1} rows / 1"],
        rows,
    )


# ---------------------------------------------------------------- 4. when guessing pays
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


def break_evens(prices: dict, max_rows: int) -> dict[int, list]:
    """Per batch, the break-even acceptance of k = 1 .. max_rows - 1 guesses (None without a price)."""
    return {
        batch: [None if price is None else break_even(price[k], k) for k in range(1, max_rows)]
        for batch, price in prices.items()
    }


def shown_rate(rate: float | None) -> str:
    return "never" if rate is None else f"{rate:.2f}"


def show_break_even(prices: dict, evens: dict, max_rows: int) -> None:
    def price(batch: int, k: int) -> str:
        return "-" if prices[batch] is None else f"{prices[batch][k]:.2f}x"

    rows = [
        [k, f"{tokens_per_pass(0.8, k):.2f}", price(1, k), shown_rate(evens[1][k - 1]), price(BATCH, k)]
        + [shown_rate(evens[BATCH][k - 1])]
        for k in range(1, max_rows)
    ]
    table(
        "guessing pays when (1 - a^(k+1)) / (1 - a) tokens per pass beat the pass's price",
        ["k", "tokens at a=0.8", "batch 1 price", "pays above a", f"batch {BATCH} price", "pays above a"],
        rows,
    )
    console.print(
        "k: guesses per pass; tokens at a=0.8: what a pass gives when each guess is kept with "
        "probability 0.8; price: the pass over k + 1 rows, in 1-row passes (part 3)"
    )


# ---------------------------------------------------------------- plot, numbers, meaning
def plot(step: dict, prices: dict, evens: dict, results: dict, max_rows: int, out_dir) -> None:
    fig, ((ax_step, ax_speed), (ax_rows, ax_even)) = plt.subplots(2, 2, figsize=(14, 9))
    plot_rollback(ax_step, step)
    rows, ks = list(range(1, max_rows + 1)), list(range(1, max_rows))
    unpriced = [batch for batch, price in prices.items() if price is None]
    for (batch, price), marker in zip(prices.items(), ("o", "s")):
        if price is None:
            continue
        ax_rows.plot(rows, price, marker=marker, label=f"batch {batch}")
        ax_even.plot(
            ks, [NEVER if r is None else r for r in evens[batch]], marker=marker, label=f"batch {batch}"
        )
    ax_rows.plot(rows, rows, linestyle="--", color="grey", label="every row full price")
    ax_rows.set(
        xlabel="query rows per sequence (k + 1)",
        ylabel="pass time / 1-row pass time",
        xticks=rows,
        title="3. The price of a row"
        + "".join(f"\nbatch {batch}: passes of one size only, no price" for batch in unpriced),
    )
    for (name, r), color in zip(results.items(), ("#2ca02c", "#d62728", "#9467bd")):
        guessed = r["speculative"]
        if guessed["drafts"]:
            ax_even.axhline(
                guessed["acceptance_rate"],
                color=color,
                linestyle="--",
                label=f"measured alone: {name} ({guessed['acceptance_rate']:.2f})",
            )
    ax_even.set(
        xlabel="k guesses",
        ylabel="acceptance rate",
        ylim=(0, 1.1),
        xticks=ks,
        title="4. Break-even acceptance: guessing pays above a batch's curve",
    )
    if any(r is None for batch in prices if prices[batch] for r in evens[batch]):
        ax_even.set_yticks(
            [0, 0.2, 0.4, 0.6, 0.8, 1.0, NEVER], ["0", "0.2", "0.4", "0.6", "0.8", "1", "never"]
        )
    names = list(results)
    for offset, side in ((-0.2, "plain"), (0.2, "speculative")):
        bars = ax_speed.bar(
            [i + offset for i in range(len(names))],
            [results[n][side]["tok_s"] for n in names],
            0.4,
            label=side,
        )
    ax_speed.bar_label(bars, [f"{results[n]['speedup']:.2f}x" for n in names], fontsize=8)
    ax_speed.set_xticks(range(len(names)), names)
    ax_speed.margins(y=0.12)
    ax_speed.set(ylabel="decode tokens/s, batch 1", title="2. End to end, alone (on the bar: speed-up)")
    for ax in (ax_rows, ax_speed):
        ax.legend(fontsize=8)
    ax_even.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3)  # off the lines
    fig.tight_layout()
    save_plot(fig, out_dir, "14_speculation.png")


NEVER = 1.05  # where part 4's panel draws "no acceptance rate pays"
SLOT_STATES = ["not held", "empty slot", "computed", "guess kept", "guess rejected"]
SLOT_COLOURS = ["white", "#eeeeee", "#4c72b0", "#55a868", "#c44e52"]


def plot_rollback(ax, step: dict) -> None:
    """Part 1: the block table's end at three moments, one cell per KV slot, coloured by what it holds."""
    guesses, kept = len(step["guesses"]), step["kept"]
    before = step["entries_before"] + 1  # the entries, and the token the step decodes from
    moments = [
        ("before the step", step["before"], step["entries_before"]),
        (f"{guesses} guesses written", step["written"], before + guesses),
        (f"rolled back ({kept} kept)", step["rolled_back"], before + kept),
    ]
    first = max(0, len(step["before"]["table"]) - 2)  # the blocks the step touches, as the table shows
    last = max(len(picture["table"]) for _, picture, _ in moments)
    slots = range(first * DEMO_BLOCK, last * DEMO_BLOCK)
    grid = []
    for row, (_, picture, entries) in enumerate(moments):
        cells = []
        for slot in slots:
            index = slot // DEMO_BLOCK
            if index >= len(picture["table"]):
                cells.append(0)
            elif slot >= entries:
                cells.append(1)
            elif slot < before:
                cells.append(2)
            else:
                cells.append(3 if slot < before + kept else 4)
            if slot % DEMO_BLOCK == 0 and index < len(picture["table"]):
                ax.text(
                    slot - slots.start + DEMO_BLOCK / 2 - 0.5,
                    row,
                    f"block {picture['table'][index]}",
                    ha="center",
                    va="center",
                    fontsize=8,
                )
        grid.append(cells)
    ax.imshow(grid, cmap=ListedColormap(SLOT_COLOURS), vmin=0, vmax=len(SLOT_COLOURS) - 1, aspect="auto")
    for edge in range(0, len(slots) + 1, DEMO_BLOCK):
        ax.axvline(edge - 0.5, color="black", linewidth=1)
    ax.set_yticks(range(len(moments)), [label for label, _, _ in moments])
    ax.set_xticks(range(0, len(slots), DEMO_BLOCK), [str(slot) for slot in slots[::DEMO_BLOCK]])
    ax.set_xlabel(f"KV slot (token position), {DEMO_BLOCK}-token blocks")
    for state, colour in zip(SLOT_STATES[1:], SLOT_COLOURS[1:]):
        ax.bar(0, 0, color=colour, label=state)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4)
    ax.set_title(
        f"1. Rollback in one step: {guesses - kept} rejected entries cut, blocks {step['freed']} freed;\n"
        f"{step['stale_entries']} prefix-cache entries on a rejected token"
    )


def numbers_of(step: dict, fits: dict, evens: dict, results: dict, together: dict, prices: dict) -> dict:
    numbers = {
        "rollback_guesses": len(step["guesses"]),
        "rollback_kept": step["kept"],
        "rollback_blocks_freed": len(step["freed"]),
        "rollback_freed_blocks_free": step["freed_are_free"],
        "rollback_stale_prefix_entries": step["stale_entries"],
        "rollback_probe_hit_tokens": step["probe_hit_tokens"],
        "rollback_kept_entries": step["kept_entries"],
        "threads": torch.get_num_threads(),
        "pass_fit_batch_1": fits[1],
        "pass_fit_batch_16": fits[BATCH],
        "break_even_batch_1": evens[1],
        "break_even_batch_16": evens[BATCH],
        "batch_16_speedup": together["speedup"],
        "batch_16_identical": together["identical"],
    }
    for name, r in results.items():
        guessed = r["speculative"]
        numbers |= {
            f"{name}_identical": r["identical"],
            f"{name}_tokens": len(guessed["tokens"]),
            f"{name}_acceptance": guessed["acceptance_rate"],
            f"{name}_tokens_per_pass": guessed["tokens_per_pass"],
            f"{name}_drafts": guessed["drafts"],
            f"{name}_passes": guessed["passes"],
            f"{name}_plain_tok_s": r["plain"]["tok_s"],
            f"{name}_speculative_tok_s": guessed["tok_s"],
            f"{name}_speedup": r["speedup"],
            f"{name}_predicted_speedup": None if prices[1] is None else predicted_speedup(guessed, prices[1]),
            f"{name}_finish_reason": guessed["finish_reason"],
        }
    return numbers


def meaning_of_rollback(step: dict) -> str:
    rejected = len(step["guesses"]) - step["kept"]
    return (
        f"(1) A rejected guess costs its row of the pass and the K/V it wrote ({rejected} entries, "
        f"{rejected * step['kv_bytes_per_token']:,} B in part 1) and holds blocks for one step only: "
        f"the truncate gave {len(step['freed'])} back, and because blocks are registered after the "
        f"rollback, the prefix cache held {step['stale_entries']} entries on a rejected token."
    )


def verdict(name: str, r: dict, price: list[float] | None) -> str:
    """How guessing went for one prompt of part 2, against what part 3's batch-1 price predicts."""
    guessed, prompt = r["speculative"], OPEN_PROMPTS.get(name, "quoting the passage")
    if not guessed["drafts"]:
        return f"{prompt!r} never guessed, so its {r['speedup']:.2f}x is the clock's noise"
    outcome = "paid" if r["speedup"] > 1.1 else "lost" if r["speedup"] < 0.9 else "about broke even"
    predicted = (
        "" if price is None else f" (the engine's price predicts {predicted_speedup(guessed, price):.2f}x)"
    )
    return (
        f"{prompt!r} guessed in {guessed['drafts']} of {guessed['passes']} passes, kept "
        f"{guessed['acceptance_rate']:.2f} of the guesses, and {outcome}: {r['speedup']:.2f}x{predicted}"
    )


def meaning_of_price(fits: dict, prices: dict, evens: dict, together: dict) -> str:
    if prices[1] is None or prices[BATCH] is None:
        return "(3) The engine saw passes of one size only at some batch, so it fitted no price there."
    (fixed, per_row), one, many = fits[1], prices[1], prices[BATCH]
    return (
        f"(3) The engine's own fit: a decode pass costs {fixed * 1e3:.1f} ms plus {per_row * 1e3:.2f} ms "
        f"a row at batch 1, so {K + 1} rows cost {one[K]:.2f}x one; at batch {BATCH}, where every pass "
        f"already has {BATCH} rows, {K} guesses for each sequence cost {many[K]:.2f}x. (4) So {K} guesses "
        f"pay only above an acceptance rate of {shown_rate(evens[1][K - 1])} at batch 1 and "
        f"{shown_rate(evens[BATCH][K - 1])} at batch {BATCH}; all {BATCH} at once, guessing ran "
        f"{together['speedup']:.2f}x as fast."
    )


def meaning(step: dict, fits: dict, prices: dict, evens: dict, results: dict, together: dict) -> str:
    parts = "; ".join(verdict(name, r, prices[1]) for name, r in results.items())
    rates = [r["speculative"] for r in results.values() if 0 < r["speculative"]["acceptance_rate"] < 0.95]
    runs = ""
    if rates:  # the formula assumes each guess is kept independently; real guesses come right in runs
        low = min(rates, key=lambda guessed: guessed["acceptance_rate"])
        runs = (
            f" At acceptance {low['acceptance_rate']:.2f} the formula expects "
            f"{tokens_per_pass(low['acceptance_rate'], K):.2f} tokens a pass, the engine got "
            f"{low['tokens_per_pass']:.2f}: guesses are right or wrong in runs, not one by one."
        )
    return (
        f"{meaning_of_rollback(step)} (2) Greedy, with the same tokens each time: {parts}.{runs} "
        f"{meaning_of_price(fits, prices, evens, together)} Guessing pays where the output repeats its input "
        "(or itself), as far as a pass's extra rows stay cheap; a sequence guesses only as far as its recent "
        "acceptance pays for the rows at the engine's measured price, so where guesses fail it soon stops."
    )


def check_engine(results: dict) -> None:
    """Speculation is lossless: a guessing run that errs or answers other tokens is a bug, and the
    lesson stops on it rather than explain it."""
    failed = [name for name, r in results.items() if r["speculative"]["finish_reason"] == "error"]
    differ = [name for name, r in results.items() if not r["identical"]]
    if failed or differ:
        raise SystemExit(f"speculation broke the engine: errors in {failed}, other tokens in {differ}")


def main() -> None:
    args = lesson_args(__doc__)
    settings = SETTINGS["quick" if args.quick else "default"]
    torch.manual_seed(0)
    model_dir = require_model()
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)  # float32
    as_printed = quote_prompt(tokenizer, settings["passage_chars"], as_printed=True)

    console.rule("1. Rollback in KV: one step whose guesses are rejected")
    step = rollback_step(model, tokenizer, as_printed, settings["demo_tokens"])
    show_rollback(step, tokenizer)

    console.rule("2. End to end: a passage quoted, and open questions, alone and all at once")
    results, together, fits = end_to_end(model, tokenizer, settings)
    show_end_to_end(results, together, settings["new_tokens"])
    check_engine(results)

    console.rule("3. The price of a row: the engine's own fit to its passes")
    prices = price_of_rows(fits, settings["max_rows"])
    show_rows(fits, prices)

    console.rule("4. When guessing pays: the break-even acceptance rate")
    evens = break_evens(prices, settings["max_rows"])
    show_break_even(prices, evens, settings["max_rows"])

    plot(step, prices, evens, results, settings["max_rows"], args.out)
    save_numbers(args.out, "14_speculation.json", numbers_of(step, fits, evens, results, together, prices))
    console.print(f"\n[bold]What it means:[/bold] {meaning(step, fits, prices, evens, results, together)}")


if __name__ == "__main__":
    main()
