"""The manager's clock (docs/semantics.md, "set_time"; docs/eviction.md, "Retention"): the
time it gives never goes back, the switch from monotonic to manual time included, and a
refused `set_time` leaves it as it was."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError
from pagedkv_reference import ReferenceBlockManager

IMPLS = [ReferenceBlockManager, pagedkv.BlockManager]


@pytest.fixture(params=IMPLS, ids=["reference", "rust"])
def m(request: pytest.FixtureRequest) -> Any:
    return request.param(8, 4, eviction="priority")


def test_switching_to_manual_time_before_the_time_given_is_refused(m: Any) -> None:
    time.sleep(0.01)
    seen = m.now()
    assert seen > 0
    with pytest.raises(InvalidArgumentError, match="must not go back"):
        m.set_time(seen / 2)
    # Nothing changed: the clock is still monotonic, and switches at or after `seen`.
    later = m.now()
    assert later >= seen
    time.sleep(0.01)
    assert m.now() > later
    t = m.now()
    m.set_time(t)
    assert m.now() == t
    time.sleep(0.01)
    assert m.now() == t, "manual now"
    with pytest.raises(InvalidArgumentError, match="must not go back"):
        m.set_time(t - 1e-9)
    assert m.now() == t


def test_a_clock_nobody_read_may_start_manual_time_at_zero(m: Any) -> None:
    # Nothing has counted against the monotonic time: no reading is ahead of 0.
    time.sleep(0.01)
    m.set_time(0.0)
    assert m.now() == 0.0
    m.set_time(0.0)
    m.set_time(1)  # an int is a float argument
    assert m.now() == 1.0


@pytest.mark.parametrize(
    "t", [True, False, np.float32(1.0), np.array(1.0), np.int64(1), "1", None, [1.0]]
)
def test_set_time_takes_a_float_or_an_int_only(m: Any, t: object) -> None:
    with pytest.raises(InvalidArgumentTypeError, match="t must be a float"):
        m.set_time(t)
    m.set_time(np.float64(2.5))  # a float subclass
    assert m.now() == 2.5
