"""Host capacity arithmetic (moejax.layout.capacity): the drops a layout would have."""

import numpy as np
import pytest

from moejax.layout import capacity
from moejax.model.moe import dispatch, pooled


def test_rows_match_the_layer():
  for t, k, n, c, cf in ((96, 2, 4, 2, 1.25), (128, 1, 8, 4, 0.7), (7, 2, 4, 1, 3.0)):
    assert capacity.rows("slot", t, k, n, c, cf) == dispatch.capacity(t, k, n * c, cf)
    assert capacity.rows("device", t, k, n, c, cf) == pooled.device_capacity(t, k, n, cf)


def test_pooling_absorbs_a_hot_slot_beside_a_cold_one():
  # One source, 2 devices x 2 slots: device 0 holds a hot (9) and a cold (1) slot.
  loads_WxS = np.array([[9, 1, 5, 5]])
  assert capacity.dropped("slot", loads_WxS, 2, 5) == 4
  assert capacity.dropped("device", loads_WxS, 2, 10) == 0
  assert capacity.computed_by_device("slot", loads_WxS, 2, 5).tolist() == [6, 10]
  assert capacity.computed_by_device("device", loads_WxS, 2, 8).tolist() == [8, 8]


@pytest.mark.parametrize("mode", capacity.MODES)
def test_smallest_factor_is_smallest(mode):
  rng = np.random.default_rng(0)
  loads_WxS = rng.poisson(rng.lognormal(0, 1, 16) * 20, size=(8, 16))
  t, k, n, c = int(loads_WxS.sum(1).max()), 1, 4, 4
  for target in (0.0, 0.01, 0.1):
    cf = capacity.smallest_factor(mode, loads_WxS, c, t, k, target)
    cap = capacity.rows(mode, t, k, n, c, cf)
    assert capacity.dropped(mode, loads_WxS, c, cap) <= target * loads_WxS.sum()
    assert capacity.dropped(mode, loads_WxS, c, cap - 1) > target * loads_WxS.sum()
