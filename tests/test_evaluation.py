"""The perplexity harness: equal to an independent full-sequence computation when the cache is
exact, scored only through one-token decode steps (so a compressed cache is really read), and
clear errors. (Fetching the text is tested with the fetch, in test_weights_fetch.py.)"""

import json
import math

import pytest
import torch
from helpers import TEXTS_DIR

from minillm.cli import main
from minillm.config import ConfigError
from minillm.decoding.naive import sequence_logits
from minillm.engine import LLM
from minillm.evaluation import perplexity, read_text


def tiny_text(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 97, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_nll(model, segment: list[int]) -> float:
    """Mean negative log-likelihood from one no-cache forward over the segment: the independent truth."""
    logp = torch.log_softmax(sequence_logits(model, segment).float(), dim=-1)[:-1]
    return -logp.gather(1, torch.tensor(segment[1:])[:, None]).mean().item()


def test_exact_cache_gives_the_full_sequence_perplexity(tiny_dir, tiny_model):
    text = tiny_text(150)
    llm = LLM(tiny_dir, model=tiny_model, block_size=8)
    result = perplexity(llm, text, segment_len=50, num_segments=3)
    expected = sum(reference_nll(tiny_model, text[i * 50 : (i + 1) * 50]) for i in range(3)) / 3
    assert result.tokens_scored == 3 * 49
    assert result.nll == pytest.approx(expected, abs=1e-5)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-5)


def test_every_scored_token_comes_from_a_one_token_decode_step(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model)
    perplexity(llm, tiny_text(120), segment_len=40, num_segments=3)
    assert all(tokens == 1 for batch in llm.engine.stats.batches for _, tokens in batch)
    # one token per step for each of the 39 predictions, segments side by side
    assert llm.engine.stats.steps == 39


@pytest.mark.parametrize(
    "switches", [{"kv_dtype": "int4", "kv_key_scales": "token"}, {"eviction": "window", "kv_budget": 3}]
)
def test_a_compressed_cache_changes_the_perplexity(tiny_dir, tiny_model, switches):
    text = tiny_text(120, seed=1)
    exact = perplexity(LLM(tiny_dir, model=tiny_model), text, 60, 2)
    compressed = perplexity(LLM(tiny_dir, model=tiny_model, **switches), text, 60, 2)
    assert compressed.nll != pytest.approx(exact.nll, abs=1e-3)
    assert compressed.kv_bytes_per_token <= exact.kv_bytes_per_token
    assert exact.tokens_evicted == 0
    if "eviction" in switches:  # each 60-token segment ends holding 3 entries
        assert compressed.tokens_evicted == 2 * (60 - 1 - 3)


def test_too_little_text_is_refused(tiny_dir, tiny_model):
    with pytest.raises(ConfigError, match="not enough for 5 segments"):
        perplexity(LLM(tiny_dir, model=tiny_model), tiny_text(100), segment_len=50, num_segments=5)


def test_missing_text_names_the_fetch_command(tmp_path):
    with pytest.raises(ConfigError, match="weights_fetch.py"):
        read_text(tmp_path / "alice29.txt")


@pytest.mark.slow  # the real model scored through the command line (7-12 s)
def test_cli_eval_ppl_json(capsys, real_dir):
    code = main(
        [
            "eval",
            "ppl",
            "--json",
            "--segments",
            "2",
            "--segment-len",
            "24",
            "--kv-dtype",
            "int8",
            "--text",
            str(TEXTS_DIR / "lcet10.txt"),
            "--model",
            str(real_dir),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["tokens_scored"] == 2 * 23 and report["kv_dtype"] == "int8"
    assert 1 < report["perplexity"] < 1000 and report["kv_bytes_per_token"] == 13320


def test_cli_eval_ppl_bad_budget_is_one_line(capsys, real_dir):
    code = main(["eval", "ppl", "--eviction", "h2o", "--model", str(real_dir)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "needs kv_budget" in err
