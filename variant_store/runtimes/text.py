"""Text in, token ids to the graph: the tokenizer that travels inside a text model's ONNX file.

A text encoder's ONNX file carries its tokenizer (``tokenizer.json`` of the ``tokenizers`` package)
in its metadata under :data:`TOKENIZER_KEY`, with the token limit under :data:`MAX_LENGTH_KEY`.
Such a model's task signature is one ``text`` input, an Open Inference Protocol ``BYTES`` tensor
(numpy ``object`` array of ``bytes``, shape (N,)): the serving site tokenizes inside the runtime,
so callers never see token ids and the tokenizer can never disagree with the weights it was
exported with (one file, one sha256).

Elements are UTF-8; bytes that are not are decoded with replacement characters rather than
refused, as a tokenizer would treat any other unknown symbol.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mesh.errors import BadTensor, RuntimeLoadError
from mesh.types import TensorSpec

__all__ = ["MAX_LENGTH_KEY", "TEXT_INPUT", "TEXT_SPEC", "TOKENIZER_KEY", "TextFront", "text_front"]

TOKENIZER_KEY = "tiermesh.tokenizer"
MAX_LENGTH_KEY = "tiermesh.max_length"
TEXT_INPUT = "text"
TEXT_SPEC = TensorSpec(name=TEXT_INPUT, dtype="object", shape=(-1,))


class TextFront:
    """Tokenize a BYTES tensor into the graph's ``input_ids`` / ``attention_mask`` (int64, padded to
    the longest row, truncated at ``max_length`` tokens)."""

    def __init__(self, tokenizer_json: str, max_length: int, graph_inputs: tuple[str, ...]) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise RuntimeLoadError("a text model needs the 'tokenizers' package") from exc
        try:
            tok = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the Rust side raises a bare Exception for a bad file
            raise RuntimeLoadError(f"the model's tokenizer does not load: {exc}") from exc
        tok.enable_truncation(max_length=max_length)
        tok.enable_padding(pad_id=0, pad_token="[PAD]")
        self._tok = tok
        self.max_length = max_length
        self.graph_inputs = graph_inputs

    def encode(self, texts: np.ndarray) -> dict[str, np.ndarray]:
        strs = [_text(t, i) for i, t in enumerate(texts.reshape(-1))]
        enc = self._tok.encode_batch(strs)
        out = {"input_ids": np.array([e.ids for e in enc], dtype=np.int64),
               "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64)}
        if "token_type_ids" in self.graph_inputs:
            out["token_type_ids"] = np.array([e.type_ids for e in enc], dtype=np.int64)
        return {k: v for k, v in out.items() if k in self.graph_inputs}


def _text(value: object, i: int) -> str:
    if type(value) is bytes:
        return value.decode("utf-8", errors="replace")
    if type(value) is str:
        return value
    raise BadTensor(f"input '{TEXT_INPUT}'[{i}]: expected bytes or str, got {type(value).__name__}")


def text_front(metadata: Mapping[str, str], graph_inputs: tuple[str, ...]) -> TextFront | None:
    """The tokenizer a model's metadata carries, or None for a model that takes tensors."""
    tokenizer = metadata.get(TOKENIZER_KEY)
    if tokenizer is None:
        return None
    try:
        max_length = int(metadata.get(MAX_LENGTH_KEY, "128"))
    except ValueError as exc:
        raise RuntimeLoadError(f"metadata {MAX_LENGTH_KEY} is not an integer") from exc
    return TextFront(tokenizer, max_length, graph_inputs)
