"""Public-domain texts to score and to test with, from the Canterbury corpus on PyPI.

The `brotli` source package ships the Canterbury corpus as test data. We take two of its files
and write them to `weights/texts/`:

    alice29.txt   Lewis Carroll, "Alice's Adventures in Wonderland": what `minillm eval ppl`, the
                  lessons and the benchmarks read
    lcet10.txt    the proceedings of a 1992 Library of Congress workshop on electronic texts:
                  numbered lists, dates and figures; the tests' second text

Each is pinned by the sha256 of its bytes with Unix line ends (they ship with CRLF) and checked
before it is written; the archive itself is pinned by the sha256 PyPI publishes for it, and one
that does not hold the right bytes is deleted, so the next run downloads it again.
"""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

from minillm.fetch import FetchError, console
from minillm.fetch.download import file_sha256, pip_download

TEXT_SDIST = "brotli==1.2.1"
TEXT_SDIST_SHA256 = "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de"  # as PyPI publishes it
CORPUS_FOLDER = "tests/testdata"  # inside the source archive
TEXTS = {  # file name -> sha256 with Unix line ends
    "alice29.txt": "4cbce86540bcef439f901c89de486d295aa3848e8c4cbc911561054479e73960",
    "lcet10.txt": "938e69e61b3411d8a9e2e630f4265000d810f3dbf66bac58cac19493753526ec",
}


def fetch_texts(out_root: Path) -> list[Path]:
    """`out_root/texts/<name>` for each of TEXTS; a text already there and intact is left alone."""
    targets = [out_root / "texts" / name for name in TEXTS]
    missing = [
        target for target in targets if not (target.is_file() and file_sha256(target) == TEXTS[target.name])
    ]
    if missing:
        cache_dir = out_root / ".downloads" / "texts"
        cache_dir.mkdir(parents=True, exist_ok=True)
        archive = pip_download(TEXT_SDIST, TEXT_SDIST_SHA256, cache_dir, "sdist")
        for target in missing:
            text = corpus_file(archive, target.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text)
            console.print(f"Wrote {target} (public-domain text)")
    return targets


def corpus_file(archive: Path, name: str) -> bytes:
    """The corpus file `name` from the source archive, with Unix line ends, checked against its sha256."""
    member_path = f"{CORPUS_FOLDER}/{name}"
    try:
        with tarfile.open(archive) as tar:
            member = next(m for m in tar.getmembers() if m.isfile() and m.name.endswith("/" + member_path))
            text = tar.extractfile(member).read().replace(b"\r\n", b"\n")
    except (tarfile.TarError, StopIteration) as err:
        archive.unlink()
        raise FetchError(f"{archive.name} has no {member_path} ({err}); run again to re-download.") from err
    if hashlib.sha256(text).hexdigest() != TEXTS[name]:
        archive.unlink()
        raise FetchError(
            f"{member_path} in {archive.name} is not the expected text; run again to re-download."
        )
    return text
