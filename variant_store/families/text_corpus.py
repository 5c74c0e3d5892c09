"""A small, honest labelled text corpus: Debian package descriptions labelled by their archive section.

No labelled text corpus ships in an installable package here (NLTK's corpora and ``datasets``
download at run time; scikit-learn's 20 newsgroups loader downloads too). Debian's package index
does ship real human-assigned labels: every package has a one-line description and a *section*
chosen by its maintainer. This module turns the index that ``apt-cache dumpavail`` prints
(Debian 12 "bookworm", main, amd64) into ``variant_store/models/text/corpus.tsv``, which is
committed, so builds never depend on a machine's apt lists:

    python -m variant_store.families.text_corpus --out variant_store/models/text/corpus.tsv

Rows: ten topical sections (the language/library sections such as ``python`` or ``libs`` are
left out: their descriptions name a language, not a topic), at most :data:`PER_SECTION` rows
each (the first by package name), exact duplicate descriptions dropped. Two labellings of the same
rows serve two tenants: ``section`` (10 classes, ``text-topic``) and ``group`` (4 coarse groups of
sections, ``text-group``).

The split is by *source package* (hashed), so the binary packages of one source (``foo``,
``foo-data``, ``foo-doc``: near-identical descriptions) never straddle train and held-out rows:
60 % train (the heads are fitted there), then of the rest the first :data:`CALIB_COUNT` rows are
calibration data and everything after is the held-out set every accuracy is measured on.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mesh.errors import VariantBuildError

__all__ = ["CALIB_COUNT", "CORPUS", "GROUPS", "SECTIONS", "Corpus", "load_corpus", "main"]

SECTIONS: tuple[str, ...] = ("games", "sound", "graphics", "video", "science", "math", "electronics",
                             "mail", "web", "net")
GROUPS: dict[str, tuple[str, ...]] = {
    "games": ("games",),
    "media": ("sound", "graphics", "video"),
    "science": ("science", "math", "electronics"),
    "network": ("mail", "web", "net"),
}
PER_SECTION = 250
TRAIN_PERCENT = 60
CALIB_COUNT = 100
CORPUS = Path(__file__).resolve().parent.parent / "models" / "text" / "corpus.tsv"


@dataclass(frozen=True, slots=True)
class Corpus:
    """Rows of the corpus split three ways; ``y_*`` are indices into :data:`SECTIONS`."""

    train_text: list[str]
    train_y: np.ndarray
    val_text: list[str]        # calibration rows first (``CALIB_COUNT``), then held-out rows
    val_y: np.ndarray

    def holdout(self) -> tuple[np.ndarray, np.ndarray]:
        """The held-out rows (after the calibration rows) as a BYTES tensor and section labels."""
        x = np.empty(len(self.val_text) - CALIB_COUNT, dtype=object)
        x[:] = [t.encode() for t in self.val_text[CALIB_COUNT:]]
        return x, self.val_y[CALIB_COUNT:]

    @staticmethod
    def group_of(y: np.ndarray) -> np.ndarray:
        """Section indices -> group indices (in :data:`GROUPS` order)."""
        table = np.zeros(len(SECTIONS), dtype=np.int64)
        for g, secs in enumerate(GROUPS.values()):
            for s in secs:
                table[SECTIONS.index(s)] = g
        return table[y]


def _is_train(source: str) -> bool:
    return int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) % 100 < TRAIN_PERCENT


def load_corpus(path: Path | str = CORPUS) -> Corpus:
    """The committed corpus, split by source package (see the module docstring)."""
    rows: list[tuple[str, str, str]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise VariantBuildError(f"cannot read the text corpus {path}: {exc}") from exc
    for n, line in enumerate(lines[1:], start=2):
        parts = line.split("\t")
        if len(parts) != 4 or parts[2] not in SECTIONS:
            raise VariantBuildError(f"{path}:{n}: expected package, source, section, description")
        rows.append((parts[1], parts[2], parts[3]))
    train = [(s, d) for src, s, d in rows if _is_train(src)]
    val = [(s, d) for src, s, d in rows if not _is_train(src)]
    if len(val) <= CALIB_COUNT or not train:
        raise VariantBuildError(f"{path}: too few rows to split ({len(rows)})")
    return Corpus([d for _, d in train], np.array([SECTIONS.index(s) for s, _ in train], dtype=np.int64),
                  [d for _, d in val], np.array([SECTIONS.index(s) for s, _ in val], dtype=np.int64))


def _records(dump: str) -> list[dict[str, str]]:
    out = []
    for block in dump.split("\n\n"):
        rec: dict[str, str] = {}
        for line in block.splitlines():
            if line[:1] not in (" ", "\t") and ":" in line:
                key, _, value = line.partition(":")
                rec[key] = value.strip()
        if rec.get("Package"):
            out.append(rec)
    return out


def extract(dump: str) -> list[tuple[str, str, str, str]]:
    """(package, source, section, description) rows from ``apt-cache dumpavail`` output."""
    by_section: dict[str, list[tuple[str, str, str, str]]] = {s: [] for s in SECTIONS}
    seen: set[str] = set()
    for rec in sorted(_records(dump), key=lambda r: r["Package"]):
        section = rec.get("Section", "").split("/")[-1]   # "contrib/games" -> "games"
        desc = " ".join(rec.get("Description", "").split())
        if section not in by_section or len(desc.split()) < 3 or desc.lower() in seen:
            continue
        if len(by_section[section]) >= PER_SECTION:
            continue
        seen.add(desc.lower())
        source = rec.get("Source", rec["Package"]).split(" ")[0]
        by_section[section].append((rec["Package"], source, section, desc.replace("\t", " ")))
    return [row for s in SECTIONS for row in by_section[s]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m variant_store.families.text_corpus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=CORPUS)
    args = parser.parse_args(argv)
    try:
        dump = subprocess.run(["apt-cache", "dumpavail"], check=True, capture_output=True, text=True,
                              timeout=300).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"error: apt-cache dumpavail failed: {exc}", file=sys.stderr)
        return 1
    rows = extract(dump)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as fh:
        fh.write("package\tsource\tsection\tdescription\n")
        for row in rows:
            fh.write("\t".join(row) + "\n")
    counts = {s: sum(1 for r in rows if r[2] == s) for s in SECTIONS}
    print(f"{len(rows)} rows -> {args.out}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
