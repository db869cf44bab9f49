"""The loop's extra per-step figures (TIS clip share, replicas, turns) and its PNG."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from skyrl_numerics.rollout import Rollout
from skyrl_numerics.trainer.config import TrainerConfig
from skyrl_numerics.trainer.loop import LoopConfig, LoopResult
from skyrl_numerics.trainer.loop_report import step_metrics, write_loop_plot


def _rollout(lp, **kw) -> Rollout:
    n = len(lp)
    return Rollout(prompt_tokens=np.array([1, 2], np.int32), prompt_cu=np.array([0, 2]),
                   response_tokens=np.arange(n, dtype=np.int32) % 7, response_cu=np.array([0, n]),
                   rollout_logprobs=np.asarray(lp, np.float32), **kw)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-3, 3, allow_nan=False, width=32), min_size=1, max_size=40),
       st.floats(1.05, 4.0))
def test_tis_clip_frac_is_the_share_over_the_cap(d, cap):
    rollout_lp = np.full(len(d), -1.0, np.float32)
    trainer_lp = (rollout_lp.astype(np.float64) + np.asarray(d, np.float64))
    cfg = LoopConfig(name="c", trainer=TrainerConfig(correction="token_tis", correction_kwargs={"cap": cap}))
    got = step_metrics(cfg, trainer_lp, _rollout(rollout_lp), None)["tis_clip_frac"]
    ratio = np.exp(trainer_lp - rollout_lp.astype(np.float64))
    assert got == float((ratio > cap).mean())


def test_tis_clip_frac_counts_model_tokens_only_and_defaults_to_cap_2():
    rollout_lp = np.array([-2.0, np.nan, -2.0, -2.0], np.float32)   # NaN: an observation token
    trainer_lp = np.array([-1.0, -1.0, -2.0, -2.0], np.float32)     # ratio e > 2 on token 0 only
    mask = np.array([True, False, True, True])
    r = _rollout(rollout_lp, loss_mask=mask, turns=np.array([0, 1, 1, 1], np.int32))
    cfg = LoopConfig(name="bitwise", recipe="ml4")            # a recipe: measured at cap 2
    assert step_metrics(cfg, trainer_lp, r, _Gap())["tis_clip_frac"] == 1 / 3
    # no correction and no recipe: nothing reported
    assert "tis_clip_frac" not in step_metrics(LoopConfig(name="plain"), trainer_lp, r, _Gap())


class _Gap:
    per_turn = [{"max_abs": 0.5, "mean_abs": 0.25}]


def test_loop_plot_is_a_png_with_the_recipe_panels(tmp_path):
    rows = [{"step": s, "reward": 0.1 * s, "gap_mean_abs": 0.0, "grad_cos_onpolicy": 1.0,
             "grad_relerr_onpolicy": 0.0, "tis_clip_frac": 0.0, "sync_raw_bytes": 100,
             "sync_payload_bytes": 40, "sync_full_model_bytes": 400, "time_generate_s": 1.0,
             "time_train_s": 2.0, "time_sync_s": 0.5} for s in range(3)]
    path = tmp_path / "train.png"
    write_loop_plot(path, LoopResult(settings={}, history={"bitwise": rows}))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert w > 2 * h          # 2 rows of 4 panels (reward, gap, cos, relerr | tis, bytes, time)
