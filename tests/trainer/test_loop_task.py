"""The loop's verifiable task (no engine needed)."""
import numpy as np

from skyrl_numerics.rollout import Rollout
from skyrl_numerics.trainer.loop import TargetSetTask


def test_target_set_reward_hand_values():
    ro = Rollout.from_lists([[1], [2], [3]], [[5, 70, 63, 64], [100], []],
                            [[-1.0] * 4, [-1.0], []])
    np.testing.assert_array_equal(TargetSetTask(64).reward(ro), [0.5, 0.0, 0.0])
    np.testing.assert_array_equal(TargetSetTask(101).reward(ro), [1.0, 1.0, 0.0])
