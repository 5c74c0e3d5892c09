"""The SDK's tensors: numpy arrays where numpy is installed, :class:`mesh.v2.plain.Tensor` where it is not.

``pip install tiermesh`` (the base install, for a device that only calls the mesh) brings no numpy; the
``numpy`` extra, and every server role, do. Which one this process has is decided once, at import, by whether
numpy can be found; a broken numpy install still fails loudly on import. Both sides offer the same calls, so
``mesh.client`` is written once:

    is_single(x)      x feeds a task's single input (not a dict of inputs by name)
    ready(named)      every input is already a tensor of this side (no task signature needed to convert it)
    prepare(named, sig)   the tensors to send, and the key of their names, datatypes and shapes (empty when a
                      BYTES tensor makes the header's size depend on contents: no kept header)
    tensor_data, encode_infer_request, decode_infer_response   the codec of this side

With numpy, ndarrays go out and come back exactly as before this module existed; lists, ``array.array`` and
``Tensor`` inputs are converted to the task's dtypes. Without it, a caller passes nested lists, ``array.array``,
``str``/``bytes`` lists for BYTES inputs, or ``Tensor`` objects, and gets ``Tensor`` outputs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mesh.errors import BadTensor
from mesh.types import TaskSignature
from mesh.v2.datatypes import BYTES, BYTES_NAME, NAME_TO_V2
from mesh.v2.plain import Tensor, as_tensor, fit_shape

NUMPY = importlib.util.find_spec("numpy") is not None

if TYPE_CHECKING or NUMPY:
    import numpy as np

    from mesh.bytes_tensor import as_bytes_tensor
    from mesh.v2.codec import decode_infer_response, encode_infer_request
    from mesh.v2.tensors import tensor_data
else:  # used through this module by mesh.client (wire.encode_infer_request, ...)
    from mesh.v2.plain import decode_infer_response, encode_infer_request, tensor_data  # noqa: F401

# and this side's codec, chosen above: tensor_data, encode_infer_request, decode_infer_response
__all__ = ["NUMPY", "is_single", "prepare", "ready"]

ShapeKey = tuple[Any, ...]


def _specs(sig: TaskSignature | None) -> dict[str, Any]:
    return {s.name: s for s in sig.inputs} if sig is not None else {}


def _numpy_input(name: str, value: Any, spec: Any) -> np.ndarray:
    if type(value) is np.ndarray or isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, Tensor):
        arr = np.asarray(value)
    elif spec is not None and spec.dtype == BYTES_NAME:
        return as_bytes_tensor(value)
    else:
        try:
            arr = np.asarray(value, dtype=spec.dtype if spec is not None else None)
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadTensor(f"input {name!r}: values are not {spec.dtype if spec else 'a tensor'}: {exc}") from exc
        if spec is not None:
            arr = arr.reshape(fit_shape(arr.shape, spec.shape))
    # numpy str_/bytes_/object arrays (np.array(["a", "b"])) are the BYTES tensor a text task takes
    return as_bytes_tensor(arr) if arr.dtype.kind in "USO" else arr


def _plain_input(name: str, value: Any, spec: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if spec is None:
        raise BadTensor(f"input {name!r}: the task has no input of that name")
    return as_tensor(value, NAME_TO_V2.get(spec.dtype, spec.dtype), spec.shape, f"input {name!r}")


def _numpy_key(tensors: dict[str, Any]) -> ShapeKey:
    key = []
    for k, t in tensors.items():
        dt = t.dtype
        if dt.hasobject:
            return ()
        key.append((k, dt, t.shape))
    return tuple(key)


def _plain_key(tensors: dict[str, Any]) -> ShapeKey:
    if any(t.datatype == BYTES for t in tensors.values()):
        return ()
    return tuple((k, t.datatype, t.shape) for k, t in tensors.items())


_ARRAY: type = np.ndarray if NUMPY else Tensor
_input, _key = (_numpy_input, _numpy_key) if NUMPY else (_plain_input, _plain_key)


def prepare(named: Mapping[str, Any], sig: TaskSignature | None) -> tuple[dict[str, Any], ShapeKey]:
    if NUMPY and len(named) == 1:
        # the common case, one array of numbers: no signature needed, nothing to convert
        (name, value), = named.items()
        if type(value) is np.ndarray and value.dtype.kind not in "USOV":
            return {name: value}, ((name, value.dtype, value.shape),)
    specs = _specs(sig)
    tensors = {k: _input(k, v, specs.get(k)) for k, v in named.items()}
    return tensors, _key(tensors)


def is_single(inputs: object) -> bool:
    # the common case first, by exact type: isinstance against Mapping (an ABC) costs a micro-second
    return type(inputs) is _ARRAY or not (type(inputs) is dict or isinstance(inputs, Mapping))


def ready(named: Mapping[str, Any]) -> bool:
    return all(isinstance(v, _ARRAY) for v in named.values())
