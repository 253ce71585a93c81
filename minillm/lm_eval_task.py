"""lm-evaluation-harness as a client: a cloze task from "Alice in Wonderland", and the checkpoint
as a Hugging Face model, so one task is scored two ways and the scores can be compared.

An evaluation harness scores a multiple-choice item by log-likelihood: for each choice it asks
log p(continuation | context), here through `minillm serve` (`local-completions`: the context and
the continuation as token ids, `echo` and `logprobs` give each prompt token's log-probability)
and through HF transformers (`hf`) on the same weights. Both must pick the same choices, with
log-likelihoods equal to float error; `tests/test_lm_eval.py` checks it.

The task is built here, offline and deterministically: sentences of `alice29.txt` (public
domain, `python weights_fetch.py` fetches it) with their last word cut off; the choices are that
word and three other sentences' last words, drawn with a fixed seed. lm-eval reads the items as
local JSON (`dataset_path: json`), so nothing comes from the hub.

The `hf` backend needs a Hugging Face tokenizer: the weights folder holds one, `tokenizer.json`,
which minillm reads too (`tokenizer.py`), and `hf_tokenizer` loads it with transformers. It must
cut every item exactly as `Tokenizer` does, or the two log-likelihoods would score different
tokens; `check_tokenization` says where they differ, and `write` refuses a task they disagree on.

    python -m minillm.lm_eval_task OUT_DIR                    # the task, the HF folder, the lm_eval commands
    python -m minillm.lm_eval_task OUT_DIR --compare serve hf # then: accuracy and max |delta| per choice
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from minillm.config import ConfigError, is_gguf
from minillm.evaluation import DEFAULT_TEXT, read_text
from minillm.tokenizer import TOKENIZER_FILE, Tokenizer

TASK_NAME = "alice_cloze"
DEFAULT_MODEL = Path("weights") / "SmolLM2-135M-Instruct"
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# a plain sentence: no quotation marks, no digits, ending in a lower-case word and a full stop
CLOZE_SENTENCE = re.compile(r"[A-Z][A-Za-z,;:' -]*\s([a-z]{3,})\.")
MIN_WORDS, MAX_WORDS = 8, 24  # short contexts: a test scores 24 items x 4 choices in seconds


# ----------------------------------------------------------------------------- the items


def sentences(text: str) -> list[str]:
    """The text's sentences, each on one line: paragraphs (blank-line separated) with their line
    breaks made spaces, cut after . ! or ?"""
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return [s for p in paragraphs for s in SENTENCE_END.split(p) if s]


def cloze_items(text: str, count: int, seed: int = 0) -> list[dict]:
    """`count` items {"context", "choices", "answer"}: a sentence without its last word, that word
    among three other sentences' last words (in an order drawn too), and its index. The same
    text, count and seed give the same items."""
    eligible = [
        (s, m.group(1))
        for s in sentences(text)
        if (m := CLOZE_SENTENCE.fullmatch(s)) and MIN_WORDS <= len(s.split()) <= MAX_WORDS
    ]
    if count > len(eligible):
        raise ConfigError(
            f"The text has {len(eligible)} sentences fit for a cloze item, not {count}; ask fewer."
        )
    endings = sorted({word for _, word in eligible})
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(len(eligible)), count))  # in the text's order
    items = []
    for index in chosen:
        sentence, word = eligible[index]
        choices = [word, *rng.sample([w for w in endings if w != word], 3)]
        rng.shuffle(choices)
        context = sentence[: -len(word) - 1].rstrip()  # without " word."
        items.append({"context": context, "choices": choices, "answer": choices.index(word)})
    return items


def task_yaml(data_file: Path) -> str:
    """lm-eval's task: each choice scored as the continuation " word" of the context (lm-eval's
    default target_delimiter is a space), accuracy the share of items whose answer scores highest."""
    return f"""\
task: {TASK_NAME}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data_file.resolve()))}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(out_dir: Path, items: list[dict]) -> Path:
    """OUT_DIR/alice_cloze.yaml and its items, OUT_DIR/alice_cloze.jsonl; `--include_path OUT_DIR`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data_file = out_dir / f"{TASK_NAME}.jsonl"
    data_file.write_text("".join(json.dumps(item) + "\n" for item in items))
    task_file = out_dir / f"{TASK_NAME}.yaml"
    task_file.write_text(task_yaml(data_file))
    return task_file


# ----------------------------------------------------------------------------- the HF tokenizer


def hf_tokenizer(model_dir: Path):
    """The checkpoint's own tokenizer.json as a transformers PreTrainedTokenizerFast, with its bos
    and eos tokens and chat template as minillm reads them (tokenizer_config.json), and the
    context length of config.json."""
    from transformers import PreTrainedTokenizerFast

    ours = Tokenizer(model_dir)
    model_config = json.loads((model_dir / "config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / TOKENIZER_FILE),
        bos_token=ours.bos_token,
        eos_token=ours.eos_token,
        model_max_length=model_config["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = ours.chat_template
    return tokenizer


def check_tokenization(items: list[dict], tokenizer: Tokenizer, hf) -> list[str]:
    """Where the HF tokenizer cuts an item's context, or its context and a choice, otherwise than
    `tokenizer` (lm-eval scores a continuation as the tokens the whole adds to the context's)."""
    problems = []
    for number, item in enumerate(items):
        texts = [item["context"], *(f"{item['context']} {choice}" for choice in item["choices"])]
        for text in texts:
            ours, theirs = tokenizer.encode(text), hf(text, add_special_tokens=False)["input_ids"]
            if ours != theirs:
                problems.append(f"item {number}: {text!r} is {ours} for minillm but {theirs} for HF")
    return problems


def write_hf_model(model_dir: Path, hf_dir: Path, tokenizer) -> None:
    """A folder transformers loads as the same model: the HF tokenizer's files, and config.json and
    model.safetensors linked (not copied: 538 MB) to the checkpoint's."""
    hf_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(hf_dir)
    config_file = hf_dir / "tokenizer_config.json"  # the class name transformers 4 knows too (5 maps it)
    config_file.write_text(
        json.dumps(json.loads(config_file.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    for name in ("config.json", "model.safetensors"):
        link = hf_dir / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to((model_dir / name).resolve())


# ----------------------------------------------------------------------------- the command


def write(out_dir: Path, model_dir: Path, text_file: Path, count: int, seed: int) -> None:
    """The task, checked against the HF tokenizer, and the HF model folder, into `out_dir`."""
    if is_gguf(model_dir):  # the HF folder links the checkpoint's config.json and model.safetensors
        raise ConfigError(f"{model_dir} is a GGUF file; give a checkpoint folder for the lm-eval task.")
    items = cloze_items(read_text(text_file), count, seed)
    tokenizer = Tokenizer(model_dir)
    hf = hf_tokenizer(model_dir)
    problems = check_tokenization(items, tokenizer, hf)
    if problems:
        raise ConfigError(
            f"The HF tokenizer disagrees with minillm's on {len(problems)} texts: {problems[0]}"
        )
    write_task(out_dir, items)
    write_hf_model(model_dir, out_dir / "hf", hf)


def commands(out_dir: Path, model_name: str, port: int) -> str:
    samples = "--log_samples --output_path"
    return f"""\
minillm serve --dtype float32 --port {port} &
lm_eval --model local-completions \\
    --model_args base_url=http://127.0.0.1:{port}/v1/completions,model={model_name},tokenized_requests=True \\
    --include_path {out_dir} --tasks {TASK_NAME} {samples} {out_dir}/results/serve
lm_eval --model hf --model_args pretrained={out_dir}/hf,dtype=float32 --device cpu \\
    --include_path {out_dir} --tasks {TASK_NAME} {samples} {out_dir}/results/hf"""


def read_run(run_dir: Path) -> dict[int, tuple[list[float], float]]:
    """The newest samples file `lm_eval --log_samples --output_path run_dir` wrote: each item's
    (choices' log-likelihoods, its accuracy 0 or 1), by doc_id."""
    files = sorted(run_dir.glob(f"*/samples_{TASK_NAME}_*.jsonl"))  # their names end in a timestamp
    if not files:
        raise ConfigError(f"No samples_{TASK_NAME}_*.jsonl under {run_dir}; run lm_eval there first.")
    try:
        rows = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
        return {
            int(row["doc_id"]): ([float(ll) for ll, _ in row["filtered_resps"]], float(row["acc"]))
            for row in rows
        }
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{files[-1]} is not lm-eval's samples file ({err!r}); run lm_eval again."
        ) from None


def compare(out_dir: Path, run_a: str, run_b: str) -> str:
    """Two runs' accuracy and how far apart their log-likelihoods are, choice by choice."""
    a, b = read_run(out_dir / "results" / run_a), read_run(out_dir / "results" / run_b)
    if a.keys() != b.keys() or any(len(a[doc][0]) != len(b[doc][0]) for doc in a):
        raise ConfigError(f"{run_a} and {run_b} scored different items; run both on the same task.")
    differences = [abs(x - y) for doc in a for x, y in zip(a[doc][0], b[doc][0])]
    answered_apart = sum(a[doc][1] != b[doc][1] for doc in a)
    accuracy = {
        name: sum(acc for _, acc in run.values()) / len(run) for name, run in ((run_a, a), (run_b, b))
    }
    return (
        f"{run_a}: acc {accuracy[run_a]:.4f}, {run_b}: acc {accuracy[run_b]:.4f} ({len(a)} items); "
        f"max |delta log-likelihood| {max(differences):.2e} over {len(differences)} choices; "
        f"{answered_apart} items right in one run and wrong in the other"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minillm.lm_eval_task",
        description=f"Write lm-eval's {TASK_NAME} task (cloze items from a public-domain text) and "
        "the checkpoint as a Hugging Face model folder into OUT_DIR, and print the lm_eval commands "
        "that score it through `minillm serve` and through HF transformers.",
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    parser.add_argument("--items", type=int, default=48, help="cloze items (default: 48)")
    parser.add_argument("--seed", type=int, default=0, help="draws the items and choices (default: 0)")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help=f"(default: {DEFAULT_MODEL})")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help=f"(default: {DEFAULT_TEXT})")
    parser.add_argument("--port", type=int, default=8000, help="the server's port in the commands")
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("RUN", "RUN"),
        help="instead: compare two runs' samples, OUT_DIR/results/RUN each (e.g. serve hf)",
    )
    args = parser.parse_args(argv)
    if args.items < 1:
        parser.error(f"--items {args.items} is not a positive count; give 1 or more")
    try:
        if args.compare:
            print(compare(args.out_dir, *args.compare))
            return 0
        write(args.out_dir, args.model, args.text, args.items, args.seed)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out_dir = args.out_dir.resolve()
    print(f"wrote {out_dir}/{TASK_NAME}.yaml ({args.items} items) and {out_dir}/hf; then run:")
    print(commands(out_dir, args.model.name, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
