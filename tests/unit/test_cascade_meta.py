"""Issue 33: a cascade's catalog entry read as hostile input (variant_store.cascade_meta, cascade_catalog), and the
mesh's view holding cascades (core_scheduler.state.view_state): a bad value keeps the last good entry."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from core_scheduler.state.view_state import ViewState
from mesh.errors import ProtocolError
from variant_store.cascade_catalog import decode_cascade
from variant_store.cascade_meta import CascadeMeta, confidence

pytestmark = pytest.mark.unit
KEY = "cascades/digits/c1"


def _entry(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"schema": 1, "task": "digits", "cascade_id": "c1", "stages": ["a.int8", "b.fp32"],
                         "rule": "max_softmax", "thresholds": [0.9], "accuracy": 0.98, "escalation": [0.12],
                         "target_accuracy": 0.975, "calibration_rows": 262, "heldout_rows": 257,
                         "owner": "public", "created": 1.0}
    d.update(over)
    return d


def test_round_trip() -> None:
    meta = CascadeMeta.from_json(_entry())
    assert CascadeMeta.from_json(meta.to_json()) == meta
    assert decode_cascade(KEY, meta.to_json()) == meta
    three = _entry(stages=["a", "b", "c"], thresholds=[0.9, 0.5], escalation=[0.3, 0.1])
    assert CascadeMeta.from_json(three).stages == ("a", "b", "c")


@pytest.mark.parametrize("bad", [
    "not an object", None, [1, 2],
    _entry(stages="a,b"), _entry(stages=["a"]), _entry(stages=["a", "a"]), _entry(stages=["a", 3]),
    _entry(stages=["a/b", "c"]), _entry(rule="entropy"), _entry(thresholds=[0.9, 0.8]), _entry(thresholds=[]),
    _entry(thresholds=[math.nan]), _entry(thresholds=[1.5]), _entry(thresholds=["0.9"]), _entry(thresholds=[True]),
    _entry(accuracy=math.nan), _entry(accuracy=math.inf), _entry(escalation=[-0.1]), _entry(escalation=[0.1, 0.2]),
    _entry(stages=["a", "b", "c"], thresholds=[0.9, 0.5], escalation=[0.1, 0.3]),  # escalation cannot grow
    _entry(calibration_rows=0), _entry(heldout_rows=1.5), _entry(heldout_rows=True), _entry(created=-1),
    _entry(created=math.nan), _entry(schema=2), _entry(schema="1"), _entry(task=""), _entry(cascade_id="a/b"),
    _entry(owner=7), {k: v for k, v in _entry().items() if k != "accuracy"},
])
def test_hostile_entries_are_refused_with_value_error(bad: Any) -> None:
    with pytest.raises(ValueError):
        CascadeMeta.from_json(bad)
    with pytest.raises(ValueError):
        decode_cascade(KEY, bad)


def test_key_must_name_the_entry() -> None:
    with pytest.raises(ValueError):
        decode_cascade("cascades/other/c1", _entry())
    with pytest.raises(ValueError):
        decode_cascade("cascades/digits/c2", _entry())
    with pytest.raises(ValueError):
        decode_cascade("catalog/digits/c1", _entry())


def test_confidence_rules() -> None:
    logits = np.array([[0.0, 0.0], [10.0, 0.0], [np.nan, 1.0]])
    assert confidence("max_softmax", logits)[:2] == pytest.approx([0.5, 1.0], abs=1e-4)
    assert confidence("margin", logits)[:2] == pytest.approx([0.0, 1.0], abs=1e-4)
    assert confidence("max_softmax", logits)[2] == 0.0


def test_view_state_keeps_the_last_good_cascade() -> None:
    state = ViewState()
    assert state.put(KEY, _entry(), 5) == "cascade"
    good = state.cascades["digits"]["c1"]
    assert state.revisions["cascade"] == 5
    out = state.put(KEY, _entry(thresholds=[math.nan]), 6)
    assert isinstance(out, ProtocolError) and KEY in state.rejected
    assert state.cascades["digits"]["c1"] is good
    fresh = ViewState()  # a re-read that finds the bad value keeps what the state in force held
    assert isinstance(fresh.put(KEY, {"task": 1}, 7, before=state), ProtocolError)
    assert fresh.cascades["digits"]["c1"] is good
    assert isinstance(state.put("cascades/digits/c1/deeper", _entry(), 8), ProtocolError)
    assert state.delete(KEY, 9) == "cascade"
    assert "digits" not in state.cascades and KEY not in state.rejected
    assert state.revisions["cascade"] == 9
