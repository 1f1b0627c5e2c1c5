"""Memory accounting: fsep keeps 1/N of every expert, restores C slots per layer."""

from __future__ import annotations

from moejax.strategy.memory import FP32, expert_bytes, report


def test_ep_and_fsep_bytes():
  ep = expert_bytes("ep", layers=2, experts=8, d_model=4, d_ff=8, devices=4)
  fs = expert_bytes("fsep", layers=2, experts=8, d_model=4, d_ff=8, devices=4,
                    slots_per_device=4)
  per_expert = 3 * 4 * 8
  assert ep["persistent"] == 3 * 2 * 2 * per_expert * FP32        # 2 experts per device
  assert fs["persistent"] == 3 * 2 * 8 * per_expert // 4 * FP32   # 1/4 of all 8 experts
  assert ep["persistent"] == fs["persistent"]                     # same total, spread out
  assert fs["transient"] == (2 * 8 * per_expert // 4 + 2 * 2 * 4 * per_expert) * FP32
  assert "fsep C=4" in report(2, 8, 4, 8, 4, fsep_slots=4)
