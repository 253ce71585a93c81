"""Helpers the tests share: the tiny random Llama's config and checkpoint writer, where the real
checkpoint and texts live, the independent references the soaks check against, and small tools
(a failing sampler, strict JSON, a KV-event router, a redis-server of a test's own), and what the
memory system shows through its door (the `Snapshot` a new subscriber hears, the blocks the prefix
cache would give, a sequence's slots, a drained pool). Fixtures and hooks stay in conftest.py;
test modules import from here, never from each other.
"""

import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch
from hypothesis import strategies as st
from safetensors.torch import save_file

from minillm.decoding import generate
from minillm.engine import SamplingParams
from minillm.engine.beam import reference_beam_search
from minillm.fetch.shapes import random_tensors
from minillm.memory.events import Snapshot
from minillm.memory.replay import Replayer
from minillm.tokenizer_json import bytes_to_unicode

REAL_MODEL_DIR = Path(
    os.environ.get("MINILLM_MODEL_DIR", Path(__file__).parent.parent / "weights" / "SmolLM2-135M-Instruct")
)
GGUF_CACHE = REAL_MODEL_DIR.parent / ".downloads" / REAL_MODEL_DIR.name
TEXTS_DIR = REAL_MODEL_DIR.parent / "texts"  # alice29.txt, lcet10.txt (see minillm/fetch/texts.py)
LOCK_WAIT_S = 600  # the longest a worker waits for another's naive decode of the same prompt

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
}


def random_llama_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names, scaled so activations stay O(1) (`--shape`'s maker)."""
    return random_tensors(config, seed)


def write_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return folder


def tiny_with_real_tokenizer(folder: Path, real_dir: Path, **config_overrides) -> Path:
    """The tiny random Llama with the real model's tokenizer (vocabulary and chat template) in
    `folder`: real text in, random-weight speed."""
    vocab_size = json.loads((real_dir / "config.json").read_text())["vocab_size"]
    config = {**TINY_CONFIG, "vocab_size": vocab_size, **config_overrides}
    write_checkpoint(folder, config, random_llama_tensors(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real_dir / name).is_file():
            shutil.copy(real_dir / name, folder)
    return folder


def tiny_gpt2_tokenizer_json() -> dict:
    """The smallest GPT-2-layout tokenizer: the 256 bytes, three merges, one special token."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab |= {"Ġt": 256, "he": 257, "Ġthe": 258}
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 259, "content": "<|end|>", **flags, "special": True}],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": ["Ġ t", "h e", "Ġt he"],
        },
    }


def sentencepiece_tokenizer_json() -> dict:
    """A small tokenizer.json laid out as Llama 2's is (SentencePiece's algorithm saved as BPE): a
    space written "▁" by the normalizer, a byte with no token written as its <0xNN> token, <s> as
    BOS. minillm must refuse it; `tokenizers` reads it."""

    def token(content: str, token_id: int) -> dict:
        flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
        return {"id": token_id, "content": content, **flags, "special": True}

    pieces = ["▁", "t", "h", "e", "▁t", "he", "▁the"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab |= {piece: 259 + i for i, piece in enumerate(pieces)}
    bos = {"id": "<s>", "ids": [1], "tokens": ["<s>"]}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [token("<unk>", 0), token("<s>", 1), token("</s>", 2)],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": bos},
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [["▁", "t"], ["h", "e"], ["▁t", "he"]],
        },
    }


def set_chat_template(folder: Path, template: str | None) -> Path:
    """`folder`'s tokenizer (tokenizer_config.json) with `template` as its chat template; None:
    without one."""
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}))
    return folder


# GGUF blocks: weights on a block format's grid, so reading the blocks is lossless, and the fused
# decode layer held to the torch layer on them.
def snap_to_blocks(tensors: dict[str, torch.Tensor], fmt: str) -> tuple[dict, dict, dict]:
    """Every matrix of `tensors` (Hugging Face names) snapped to `fmt`'s grid (quantized, then
    dequantized by the `gguf` package): (the snapped tensors, their blocks, each one's format), as
    weights_fetch.py writes the real model's blocks. Dense weights and blocks then hold the same
    values, so decoding through the blocks must give the dense model's tokens."""
    from gguf import GGMLQuantizationType, dequantize, quantize

    kind = GGMLQuantizationType[fmt.upper()]
    snapped, packed, formats = dict(tensors), {}, {}
    for name, tensor in tensors.items():
        if tensor.dim() == 2:
            blocks = quantize(tensor.float().numpy(), kind)
            snapped[name] = torch.from_numpy(dequantize(blocks, kind).astype("float32"))
            packed[name], formats[name] = torch.from_numpy(blocks), fmt
    return snapped, packed, formats


class _ValuesAttention:
    """Attention that returns the values repeated over the query heads: no memory to differ in."""

    def attend(self, layer_idx, q, k, v):
        return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1).contiguous()


def assert_fused_layers_equal_unfused(model, positions: list[int], seed: int = 4) -> None:
    """Block.forward_fused against model.py's torch layer on the same blocks, layer after layer:
    bf16 rounds every operation as torch does (equal but for SiLU's last bit), fp32 within fp32
    rounding."""
    dtype = model.dtype
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(positions), model.config.hidden_size, generator=gen).to(dtype)
    where = torch.tensor(positions)
    cos, sin = model.rope_cos[where].to(dtype), model.rope_sin[where].to(dtype)
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
    for layer in model.layers:
        assert layer.fused
        fused = layer.forward_fused(hidden, cos, sin, _ValuesAttention())
        layer.fused = False
        unfused = layer(hidden, cos, sin, _ValuesAttention())
        layer.fused = True
        assert (fused.double() - unfused.double()).abs().max() <= tolerance * unfused.abs().max().item()
        hidden = unfused


# The tiny model's KV bytes per token, its soaks' references, and the KV events they replay.
KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32


def expected_outputs(model, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """What an independent reference gives: naive decoding, seeded naive draws, the reference search."""
    if params.beam_width > 1:
        return reference_beam_search(model, prompt, params.beam_width, params.max_tokens, frozenset())
    return [
        generate(
            model,
            prompt,
            SamplingParams(
                temperature=params.temperature,
                seed=(params.seed or 0) + i,
                max_tokens=params.max_tokens,
                ignore_eos=True,
            ),
            "naive",
        ).token_ids
        for i in range(params.n)
    ]


def assert_replayed(replayer: Replayer, kv_cache) -> None:
    """The state rebuilt from the KV events alone equals the block manager's (asked through the door)."""
    kv_cache.check_invariants(replayer)


def heard_snapshot(engine) -> Snapshot:
    """The state now as a new subscriber hears it first (`memory/events.py`): tables, and every
    prefix-cache entry (block, key, parent key, tokens), parents first."""
    heard = []

    def listen(step, event):
        heard.append(event)

    engine.subscribe(listen)()  # subscribed, and off again
    return heard[0]


def cached_chains(engine) -> list[list[int]]:
    """The tokens each block the prefix cache vouches for stands for, from its chain's first block."""
    chains: dict[int, list[int]] = {}  # key -> tokens from the chain's start (parents come first)
    for _, key, parent, tokens in heard_snapshot(engine).cached:
        chains[key] = (chains[parent] if parent is not None else []) + list(tokens)
    return list(chains.values())


def cached_blocks(engine, token_ids: list[int]) -> list[int]:
    """The blocks the prefix cache would give `token_ids` (its longest cached prefix of full blocks,
    all but the last token), found from the `Snapshot` a new subscriber hears: block by block, by
    its tokens under its parent's key."""
    state = heard_snapshot(engine)
    size, found = state.block_size, []
    entries = {(parent, tuple(tokens)): (block, key) for block, key, parent, tokens in state.cached}
    parent = None
    for start in range(0, (len(token_ids) - 1) // size * size, size):
        entry = entries.get((parent, tuple(token_ids[start : start + size])))
        if entry is None:
            break
        block, parent = entry
        found.append(block)
    return found


def slots_of(engine, seq) -> list[int]:
    """The slots of the sequence's cache entries, through its block table (`LLMEngine.snapshot`)."""
    table = next(view.table for view in engine.snapshot().sequences if view.seq_id == seq.seq_id)
    size = engine.snapshot().block_size
    return [table[entry // size] * size + entry % size for entry in range(seq.num_cached)]


def naive(model, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """The oracle's answer: the naive decoder (no cache) on one prompt."""
    return generate(model, prompt_ids, params, "naive").token_ids


def random_prompts(
    count: int, seed: int, shortest: int = 2, longest: int = 30, vocab: int = 97
) -> list[list[int]]:
    """`count` prompts of random ids, each `shortest` to `longest` tokens long, the same for a seed."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(shortest, longest))] for _ in range(count)]


def assert_drained(llm) -> None:
    """After a run: no block held or leaked, the memory system's invariants intact."""
    assert free_and_intact(llm.engine)


def step_without_model(sched) -> list:
    """One engine step without a model, on a Scheduler alone: the scheduled tokens are computed,
    and every sequence whose tokens are all computed samples token 1. Returns the sequences scheduled."""
    schedule = sched.schedule()
    sched.computed(schedule, {}, {})  # no guesses, no attention kept (no H2O)
    for item in schedule.sequences:
        if item.seq.num_uncomputed == 0:
            reason = item.seq.append(1, frozenset())
            if reason:
                sched.finish(item.seq, reason)
    return [item.seq for item in schedule.sequences]


def free_and_intact(engine) -> bool:
    """Every device block is free again (none held, none leaked), and the invariants hold."""
    engine.kv_cache.check_invariants()
    snapshot = engine.snapshot()
    return snapshot.num_free_blocks == snapshot.num_blocks


def route(known: set, item: dict) -> None:
    """What a KV-aware router keeps of vLLM's events: the (block hash, medium) pairs cached."""
    if item["type"] == "AllBlocksCleared":
        known.clear()
    elif item["type"] == "BlockStored":
        known.add((item["block_hashes"][0], item["medium"]))
    else:
        known.remove((item["block_hashes"][0], item["medium"]))


# Bad requests: a sampler that fails after a few good tokens.
class FailingSampler:
    """Greedy for `good_tokens` tokens, then `fault()`: raises, or returns what it returns."""

    def __init__(self, good_tokens: int, fault):
        self.good_tokens, self.fault, self.calls = good_tokens, fault, 0

    def __call__(self, logits):
        self.calls += 1
        return int(logits.argmax()) if self.calls <= self.good_tokens else self.fault()


def raise_fault():
    raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")


# JSON: strict parsing of a `--json` command's output, and any JSON value for a fuzz test.
def strict_json(text: str) -> dict:
    """json.loads, but refusing what Python's json accepts and JSON does not: NaN, Infinity, a
    number too large for a float (1e999 -> inf), and anything beside the one object."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    def finite(number: str) -> float:
        if not math.isfinite(float(number)):
            raise ValueError(f"{number} is not a finite number")
        return float(number)

    report = json.loads(text, parse_constant=refuse, parse_float=finite)
    assert isinstance(report, dict) and text.count("\n") == 1, "one JSON object on one line"
    return report


def run_json(capsys, *argv) -> dict:
    from minillm.cli import main  # here, so every test session need not import the CLI

    code = main([str(arg) for arg in argv])
    out = capsys.readouterr().out
    assert code == 0, out
    return strict_json(out)


JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**400, -(10**30), 2**64, -1, 0, 1]),
    st.floats(),  # NaN and infinities too, written as JSON's NaN / Infinity
    st.text(st.characters(categories=["L", "N", "P", "Zs", "Cs"]), max_size=12),  # Cs: lone surrogates
)
ANY_JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


# ---------------------------------------------------------------- the real model's naive reference
# Real-model prompts the exactness tests share, so the naive decoder (minutes of recomputation on
# a small CPU) runs once per prompt per test session, not once per test.
REAL_PLAIN_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
REAL_CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    "Explain in two sentences why the sky is blue.",
]


class NaiveReference:
    """Greedy token ids of the naive decoder on one model, kept in `folder` for the rest of the
    test session and shared by every test (and every xdist worker) that asks for the same prompt.

    A greedy naive decode has no state but its token ids, so the first n tokens of a longer run
    are the n-token run, and a run resumed from prompt + stored tokens is the run continued: an
    ask for more tokens than are stored decodes only the rest. A lock per prompt makes a second
    worker wait for the first one's answer instead of decoding it again."""

    def __init__(self, model, eos_token_ids: frozenset[int], folder: Path):
        self.model, self.eos_token_ids, self.folder = model, eos_token_ids, folder
        folder.mkdir(parents=True, exist_ok=True)

    def __call__(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        import fcntl
        import hashlib

        name = hashlib.sha256(json.dumps([sorted(self.eos_token_ids), prompt_ids]).encode()).hexdigest()[:32]
        path = self.folder / f"{name}.json"
        with open(self.folder / f"{name}.lock", "w") as lock:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:  # another worker decoding this prompt: wait for it, not for ever
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, f"another worker held {name}.lock {LOCK_WAIT_S} s"
                    time.sleep(0.1)
            tokens, ended = json.loads(path.read_text()) if path.exists() else ([], False)
            if len(tokens) < max_tokens and not ended:
                rest = SamplingParams(max_tokens=max_tokens - len(tokens))
                tokens = (
                    tokens
                    + generate(self.model, prompt_ids + tokens, rest, "naive", self.eos_token_ids).token_ids
                )
                ended = tokens[-1] in self.eos_token_ids
                path.write_text(json.dumps([tokens, ended]))
        return tokens[:max_tokens]


REDIS_START_S = 10.0  # the longest a test's redis-server may take to answer PING


def free_port() -> int:
    """A TCP port nothing on 127.0.0.1 listens on now."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """A redis-server of the test's own on a free 127.0.0.1 port, saving nothing to disk; `start`
    waits for its PING (with a deadline), `stop` kills it. Use it in a `with` block, or stop it
    in a finally."""

    def __init__(self, folder: Path, *options: str):
        self.folder, self.options, self.port = folder, options, free_port()
        self.process = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def start(self) -> "RedisServer":
        import subprocess

        import redis

        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
        argv += ["no", "--dir", str(self.folder), *self.options]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + REDIS_START_S
        while True:
            assert self.process.poll() is None, f"redis-server exited ({self.process.returncode}): {argv}"
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                assert time.monotonic() < deadline, f"redis-server did not answer PING in {REDIS_START_S} s"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_until(condition, seconds: float = 10.0, what: str = "the condition") -> None:
    """Poll `condition()` until it holds; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {seconds} s"
        time.sleep(0.01)
