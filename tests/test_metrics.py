"""Host-side load statistics."""

from __future__ import annotations

import numpy as np

from moejax.train.metrics import device_load, max_over_mean, moe_layer_records


def test_device_load_sums_slots_per_device_within_each_data_row():
  # 2 data rows x 2 expert devices = 4 sources; 4 slots, 2 per device.
  slot_counts = np.array([[1, 0, 0, 0],    # row 0, source on device 0: 1 choice to slot 0
                          [0, 2, 5, 0],    # row 0, device 1: slots 1 (dev 0) and 2 (dev 1)
                          [0, 0, 3, 0],    # row 1, device 0
                          [0, 0, 0, 4]])   # row 1, device 1
  np.testing.assert_array_equal(device_load(slot_counts, 2), [3, 5, 0, 7])


def test_layer_records():
  m = {"counts_LxWxE": np.array([[[2, 2], [0, 4]]]), "dropped_LxW": np.array([[1, 0]]),
       "slot_counts_LxWxS": np.array([[[2, 2], [0, 4]]]),
       "balance_loss_L": np.array([1.5]), "z_loss_L": np.array([0.1])}
  (rec,) = moe_layer_records(m, 2)
  assert rec["expert_counts"] == [2, 6]
  assert rec["device_load"] == [2, 6]
  assert rec["max_over_mean_load"] == 1.5 == max_over_mean(np.array([2, 6]))
  assert rec["dropped_fraction"] == 1 / 8


def test_layer_records_report_realised_load_after_capacity():
  # 2 devices; device 0 computed 3 + 1 rows, device 1 computed 2 + 2 and dropped 2.
  m = {"counts_LxWxE": np.array([[[2, 2], [0, 6]]]), "dropped_LxW": np.array([[0, 2]]),
       "slot_counts_LxWxS": np.array([[[2, 2], [0, 6]]]),
       "received_LxWxN": np.array([[[3, 1], [2, 2]]]), "overflow_LxW": np.array([[0, 2]]),
       "balance_loss_L": np.array([1.5]), "z_loss_L": np.array([0.1])}
  (rec,) = moe_layer_records(m, 2)
  assert rec["max_over_mean_load"] == 8 / 5           # routed: [2, 8]
  assert rec["realised_load"] == [4, 4]
  assert rec["realised_max_over_mean"] == 1.0
  assert rec["received_by_source"] == [[3, 1], [2, 2]]
  assert rec["dropped_by_device"] == [0, 2]
