"""TRL 1.16's vLLM importance sampling, every ``vllm_importance_sampling_mode`` with and without
its lower clip, against ``integrations.trl.trl_importance_sampling`` (our corrections with
``order="trl"``, ``denominator="valid"``): bitwise on every valid token, TRL's own
``_generate_and_score_completions`` producing the reference; and the subclass recipe
(``apply_to_batch``) in TRL's own ``_compute_loss``. One child process
(``trl_correction_child.py``, which says what stands in for the vLLM engine)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework_paths import framework_dir

pytestmark = pytest.mark.slow
CHILD = Path(__file__).with_name("trl_correction_child.py")
CASES = ["token_truncate/None/3.0", "token_truncate/0.5/2.0", "sequence_truncate/None/3.0",
         "sequence_truncate/0.5/2.0", "token_mask/None/3.0", "token_mask/0.5/2.0", "token_mask/0.5/None",
         "sequence_mask/None/3.0", "sequence_mask/0.5/2.0", "sequence_mask/0.5/None"]


@pytest.fixture(scope="module")
def out() -> dict:
    env = dict(os.environ)      # as conftest.py's trl_env (module scope here: one child for the file)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(framework_dir("trl")), env.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, str(CHILD)], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_every_trl_mode_is_bitwise(out, case):
    r = out["cases"][case]
    assert r["valid"] == 179 and 0 < r["touched"] < r["valid"], r     # bounds hit and not hit
    assert r["equal"] == r["valid"], r
    assert r["float64_max_ulp"] <= 1, r     # our float64 path: exp rounded once vs float32 exp


def test_the_subclass_recipe_in_trls_loss(out):
    r = out["recipe"]
    assert r["trl_mode_ratio_bits_equal"] and r["trl_mode_loss_bits_equal"], r
    assert 0 < r["kept"] < r["valid"] and r["num_items_in_batch"] == r["kept"] and r["trl_num_items"] == r["valid"], r
    assert r["advantages_nonzero"] > 0 and r["loss_ours"] == pytest.approx(r["loss_expected"], rel=1e-6), r
    assert r["loss_ours"] != pytest.approx(r["loss_own"], rel=1e-3), r    # the denominators differ
    assert r["logged_gap_mean_abs"] > 0 and r["logged_frac_tokens_masked"] == pytest.approx(1 - r["kept"] / r["valid"])
