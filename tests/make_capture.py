"""Regenerate tests/data/capture_tiny/, the capture that the tests read (no GPU needed):

    OMP_NUM_THREADS=1 python tests/make_capture.py

Two optimizer steps of train-parity's ``tiny`` model (2 layers, d_model 64, 2 heads of 32) on 512
tokens of the standard-library corpus, with the built-in ``bf16`` kernel in both attention layers:
four calls (2 layers x 2 steps), each with q, k, v, cu_seqlens and dout, about 1 MB in all. Seeds
are fixed and torch runs on one thread, so a rerun on the same machine (same Python, whose standard
library is the corpus, and same torch) writes the same files with the same hashes; the manifest's
``meta.corpus_fingerprint`` and ``torch`` say which ones made it. The new capture is written beside
the old one and replaces it only once complete.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: the package of this checkout
    sys.path.insert(0, str(ROOT))

from flamia_verify.capture import load_capture  # noqa: E402
from flamia_verify.capture.store import MANIFEST  # noqa: E402
from flamia_verify.training.record import record_training_steps  # noqa: E402

#: where the tests read it
CAPTURE_DIR = ROOT / "tests" / "data" / "capture_tiny"
#: what it holds: the recording's arguments (tests/test_capture.py checks the manifest against them)
SETTINGS = {"preset": "tiny", "steps": 2, "tokens": 512, "kernel": "bf16", "seed": 0}
#: the size cap of the shipped capture (it is about 1.05 MB)
MAX_BYTES = 2_000_000


def make_capture(out: Path) -> Path:
    torch.set_num_threads(1)
    return record_training_steps(out, max_bytes=MAX_BYTES, **SETTINGS)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=CAPTURE_DIR, help="the capture directory (default: %(default)s)")
    args = parser.parse_args()
    out: Path = args.out
    fresh = out.with_name(out.name + ".new")
    for old in (out, fresh):  # replaced, so they must be captures (or leftovers of one), not anything else
        if old.exists() and not (old / MANIFEST).is_file():
            sys.exit(f"{old}: exists and holds no {MANIFEST}; not replacing it")
    if fresh.exists():
        shutil.rmtree(fresh)
    make_capture(fresh)
    capture = load_capture(fresh)
    if out.exists():
        shutil.rmtree(out)
    fresh.rename(out)
    total = sum((out / c.file).stat().st_size for c in capture)
    print(f"{out}: {len(capture)} calls, {total} bytes, sha256 {capture.sha256}")


if __name__ == "__main__":
    main()
