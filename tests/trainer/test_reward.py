"""``--reward MODULE:FUNCTION``: loading and the checks on what the function returns."""
from __future__ import annotations

import pytest

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.trainer.reward import RewardTask, load_reward


def _rollout(b=3):
    return Rollout.from_lists([[1, 2]] * b, [[3, 4, 5]] * b, [[-1.0, -2.0, -3.0]] * b)


def _file(tmp_path, body):
    f = tmp_path / "my_reward.py"
    f.write_text(body)
    return f


def test_file_and_module_rewards(tmp_path):
    f = _file(tmp_path, "import numpy as np\n"
                        "def score(ro):\n    return np.arange(len(ro), dtype=float)\n")
    task = RewardTask(load_reward(f"{f}:score"), name="score")
    assert task.reward(_rollout()).tolist() == [0.0, 1.0, 2.0]
    fn = load_reward("skyrl_numerics.trainer.loop:TargetSetTask")    # any importable callable
    assert fn is not None


@pytest.mark.parametrize("spec, match", [
    ("no-colon", "expected MODULE:FUNCTION"),
    ("nosuch_module_xyz:f", "does not import: ModuleNotFoundError"),
    ("skyrl_numerics.gap:no_such_fn", "has no function 'no_such_fn'"),
    ("missing_file.py:f", "is not a file"),
])
def test_bad_specs(spec, match):
    with pytest.raises(InputError, match=match) as ei:
        load_reward(spec)
    assert ei.value.field == "reward"


@pytest.mark.parametrize("body, match, row", [
    ("def f(ro):\n    return [1.0]\n", r"shape \(1,\); expected \(3,\)", None),
    ("def f(ro):\n    return [1.0, float('nan'), 0.0]\n", "not finite", 1),
    ("def f(ro):\n    return ['a', 'b', 'c']\n", "not numbers", None),
    ("def f(ro):\n    raise KeyError('verifier')\n", "failed: KeyError", None),
])
def test_bad_returns(tmp_path, body, match, row):
    task = RewardTask(load_reward(f"{_file(tmp_path, body)}:f"), name="f")
    with pytest.raises(InputError, match=match) as ei:
        task.reward(_rollout())
    assert ei.value.row == row


def test_cli_refuses_a_bad_reward_before_any_engine(tmp_path, capsys):
    from skyrl_numerics.cli import main

    assert main(["train", "--reward", "nosuch_module_xyz:f", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not import" in err[0]
    assert not (tmp_path / "o").exists()
