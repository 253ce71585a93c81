"""lm-evaluation-harness scores one task through `minillm serve` and through HF transformers, alike.

The task is `minillm/lm_eval_task.py`'s cloze items from "Alice in Wonderland" (24 here, to stay
fast), run by lm-eval's Python API two ways on the real SmolLM2 in fp32: `local-completions`
against a server in this process (lm-eval finds the server's tokenizer routes itself and sends
token ids, scored with `echo` and `logprobs`), and `hf` on the same weights. Each choice's
log-likelihood must agree to 1e-3 and so must the accuracy; a token dropped or shifted by the
server's echo would move a log-likelihood by whole nats. Every item must also be tokenized the
same by minillm's tokenizer, the HF tokenizer built from it, and the server's /tokenize.
"""

import json

import lm_eval
import pytest
import torch
from helpers import TEXTS_DIR
from serving import running_server

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.evaluation import read_text
from minillm.lm_eval_task import (
    TASK_NAME,
    check_tokenization,
    cloze_items,
    compare,
    hf_tokenizer,
    main,
    write_task,
)
from minillm.serve.engine_loop import EngineLoop

ITEMS = 24
TOLERANCE = 1e-3  # nats: fp32 through two implementations differs by ~1e-5


@pytest.fixture(scope="module")
def items():
    return cloze_items(read_text(TEXTS_DIR / "alice29.txt"), ITEMS)


@pytest.fixture(scope="module")
def task_dir(items, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-task")
    write_task(folder, items)
    return folder


@pytest.fixture(scope="module")
def hf_tok(real_dir):
    return hf_tokenizer(real_dir)


@pytest.fixture(scope="module")
def server_url(real_dir, real_model, real_tokenizer):
    engine = LLMEngine(
        EngineConfig(model_dir=real_dir, kv_cache_bytes=64 << 20), model=real_model, tokenizer=real_tokenizer
    )
    with running_server(EngineLoop(engine)) as url:
        yield url


def evaluate(model, task_dir) -> tuple[float, list[list[float]]]:
    """lm-eval's accuracy, and each item's choices' log-likelihoods in the task's order."""
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        tasks=[TASK_NAME],
        task_manager=TaskManager(
            include_path=str(task_dir), include_defaults=False
        ),  # not lm-eval's 12 s index
        log_samples=True,
        random_seed=None,  # leave the session's random state alone
        numpy_random_seed=None,
        torch_random_seed=None,
        fewshot_random_seed=None,
    )
    samples = sorted(results["samples"][TASK_NAME], key=lambda s: s["doc_id"])
    loglikelihoods = [[float(ll) for ll, _ in s["filtered_resps"]] for s in samples]
    return results["results"][TASK_NAME]["acc,none"], loglikelihoods


def test_every_item_is_tokenized_alike_by_minillm_hf_and_the_server(
    items, hf_tok, real_tokenizer, server_url
):
    from lm_eval.utils import RemoteTokenizer

    assert check_tokenization(items, real_tokenizer, hf_tok) == []
    assert check_tokenization(items, real_tokenizer, RemoteTokenizer(server_url)) == []


def test_lm_eval_scores_the_task_through_the_server_as_through_hf(task_dir, server_url, hf_model, hf_tok):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    served = LocalCompletionsAPI(  # lm-eval's own timeout (300 s) and retries would wait 15 min
        base_url=f"{server_url}/v1/completions",
        model="tiny",
        tokenized_requests=True,
        batch_size=16,
        timeout=60,
        max_retries=1,
    )
    assert served.tokenizer_backend == "remote"  # found the server's /tokenizer_info and /tokenize
    with torch.inference_mode():
        hf_accuracy, hf_loglikelihoods = evaluate(
            HFLM(pretrained=hf_model, tokenizer=hf_tok, batch_size=16, device="cpu"), task_dir
        )
    served_accuracy, served_loglikelihoods = evaluate(served, task_dir)

    assert served_accuracy == hf_accuracy
    differences = [abs(a - b) for x, y in zip(served_loglikelihoods, hf_loglikelihoods) for a, b in zip(x, y)]
    assert len(differences) == 4 * ITEMS and max(differences) <= TOLERANCE, max(differences)


def test_cloze_items_are_drawn_the_same_every_time(items):
    again = cloze_items(read_text(TEXTS_DIR / "alice29.txt"), ITEMS)
    assert again == items and cloze_items(read_text(TEXTS_DIR / "alice29.txt"), ITEMS, seed=1) != items
    for item in items:
        assert len(set(item["choices"])) == 4 and not item["context"].endswith(" ")


@pytest.mark.slow  # a program started as a user starts it (7-12 s)
def test_the_builder_writes_the_task_and_a_folder_transformers_loads(
    tmp_path, capsys, real_dir, real_tokenizer
):
    from transformers import AutoTokenizer

    assert main([str(tmp_path), "--items", "4", "--model", str(real_dir)]) == 0
    printed = capsys.readouterr().out
    assert "--model local-completions" in printed and f"pretrained={tmp_path}/hf,dtype=float32" in printed
    assert len((tmp_path / f"{TASK_NAME}.jsonl").read_text().splitlines()) == 4
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Alice, 1234  times!"  # digits one by one, two spaces: SmolLM2's pre-tokenizer
    assert hf(text, add_special_tokens=False)["input_ids"] == real_tokenizer.encode(text)
    assert (hf.eos_token, hf.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert (tmp_path / "hf" / "model.safetensors").resolve() == (real_dir / "model.safetensors").resolve()


def test_compare_reports_accuracy_and_the_largest_difference(tmp_path):
    for run, loglikelihoods in (("a", [[-1.0, -2.0], [-3.0, -1.0]]), ("b", [[-1.5, -2.0], [-0.5, -1.0]])):
        folder = tmp_path / "results" / run / "model"
        folder.mkdir(parents=True)
        rows = [
            {"doc_id": doc, "filtered_resps": [[str(ll), "False"] for ll in lls], "acc": str(float(doc == 0))}
            for doc, lls in enumerate(loglikelihoods)
        ]
        rows[1]["acc"] = "1.0" if run == "b" else "0.0"
        (folder / f"samples_{TASK_NAME}_2026.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = compare(tmp_path, "a", "b")
    assert "a: acc 0.5000, b: acc 1.0000 (2 items)" in report and "2.50e+00 over 4 choices" in report
    assert "1 items right in one run" in report
