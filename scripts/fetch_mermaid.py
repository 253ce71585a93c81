"""Fetch Mermaid's script from its npm package, so the docs site draws its diagrams offline.

mkdocs-material draws a ```mermaid block with the `mermaid` library, which it fetches from a CDN
(unpkg) when the page opens, unless the page already has it. This puts the pinned package's
`dist/mermaid.min.js` into `docs/javascripts/`, where `mkdocs.yml` loads it on every page: a
learner reading the built site on a train sees the diagrams too. The tarball is checked against
the registry's sha512 before anything is unpacked.

    python scripts/fetch_mermaid.py          # once; `mkdocs build` says so when it is missing
"""

import base64
import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "11.17.2"  # material 9.8 asks the CDN for mermaid@11
TARBALL = f"https://registry.npmjs.org/mermaid/-/mermaid-{VERSION}.tgz"
INTEGRITY = "sha512-V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
MEMBER = "package/dist/mermaid.min.js"
TARGET = Path(__file__).resolve().parent.parent / "docs" / "javascripts" / "mermaid.min.js"


def main() -> None:
    if TARGET.exists():
        print(f"{TARGET} is there already (mermaid {VERSION}).")
        return
    print(f"Fetching mermaid {VERSION} from the npm registry...")
    try:
        with urllib.request.urlopen(TARBALL, timeout=60) as response:
            tarball = response.read()
    except OSError as err:  # no network, a proxy, a timeout: one line, not a traceback
        sys.exit(f"Could not fetch {TARBALL} ({err}); check the connection to the npm registry and retry.")
    digest = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    if digest != INTEGRITY:
        sys.exit(f"The mermaid {VERSION} tarball does not match its registry checksum; not unpacked.")
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        script = archive.extractfile(MEMBER).read()
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    partial = TARGET.with_suffix(".part")  # renamed whole: an interrupted fetch leaves no half script
    partial.write_bytes(script)
    partial.replace(TARGET)
    print(f"Wrote {TARGET} ({len(script) / 1e6:.1f} MB).")


if __name__ == "__main__":
    main()
