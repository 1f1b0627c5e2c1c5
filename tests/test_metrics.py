"""Host-side load statistics."""

from __future__ import annotations

import numpy as np

from moejax.metrics import device_load, max_over_mean, moe_layer_records


def test_device_load_with_data_rows_and_a_shuffled_layout():
  # 2 data rows x 2 expert devices = 4 sources; 4 experts, 2 slots per device.
  counts_SxE = np.array([[1, 0, 0, 0],     # row 0, device 0
                         [0, 2, 0, 0],     # row 0, device 1
                         [0, 0, 3, 0],     # row 1, device 0
                         [0, 0, 0, 4]])    # row 1, device 1
  slot_expert = np.array([3, 0, 2, 1])     # device 0 hosts experts 3, 0; device 1 hosts 2, 1
  # Row 0 sends expert 0 (1) -> device 0 and expert 1 (2) -> device 1.
  # Row 1 sends expert 2 (3) -> device 1 and expert 3 (4) -> device 0.
  np.testing.assert_array_equal(device_load(counts_SxE, slot_expert, 2), [1, 2, 4, 3])


def test_layer_records():
  m = {"counts_LxSxE": np.array([[[2, 2], [0, 4]]]), "dropped_LxS": np.array([[1, 0]]),
       "balance_loss_L": np.array([1.5]), "z_loss_L": np.array([0.1])}
  (rec,) = moe_layer_records(m, np.array([[0, 1]]), 2)
  assert rec["expert_counts"] == [2, 6]
  assert rec["device_load"] == [2, 6]
  assert rec["max_over_mean_load"] == 1.5 == max_over_mean(np.array([2, 6]))
  assert rec["dropped_fraction"] == 1 / 8
