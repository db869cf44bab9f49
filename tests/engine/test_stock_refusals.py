"""What stock vLLM would get silently wrong is refused by field. A Qwen2 ``head_dim`` other than
``hidden_size // num_attention_heads`` (vLLM's Qwen2 ignores it): before a stock engine starts
(``head_dim``). Stock vLLM CPU models that do not take new weights in place, never synced
into a silently stale engine: up front in ``train`` (``configs``) and at the one load path
(``architectures``). The measurement behind each entry (perturb the HF weights group by group,
sync, compare the engine's logprobs with HF's) is in ``STOCK_RELOAD_BROKEN_CPU``'s text and
docs/invariant.md; no engine is started here."""
from __future__ import annotations

import pytest
import torch

from skyrl_numerics.engine.arch_check import check_stock_architecture, stock_config_problem
from skyrl_numerics.engine.weight_update import (STOCK_RELOAD_BROKEN_CPU, load_into_model,
                                                 stock_reload_problem)
from skyrl_numerics.errors import InputError
from skyrl_numerics.models import build_tiny_model, tiny_config
from skyrl_numerics.trainer.loop import CONFIGS
from skyrl_numerics.trainer.loop_actors import check_in_place_sync

_CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="measured on vLLM CPU only")


@_CPU_ONLY
def test_train_refuses_stock_configs_on_gpt_oss_and_nemotron_h_before_any_engine():
    d = build_tiny_model("gpt_oss")
    with pytest.raises(InputError, match="GptOssForCausalLM") as e:
        check_in_place_sync(d, [CONFIGS["plain"], CONFIGS["aligned"]])
    assert e.value.field == "configs"
    check_in_place_sync(d, [CONFIGS["bitwise"]])           # the invariant engine takes updates
    check_in_place_sync(build_tiny_model("mixtral"), [CONFIGS["aligned"]])   # measured: follows
    with pytest.raises(InputError, match="conv1d") as e:
        check_in_place_sync(build_tiny_model("nemotron_h"), [CONFIGS["aligned"]])
    assert e.value.field == "configs"


@_CPU_ONLY
def test_the_load_path_refuses_before_touching_the_model():
    """``load_into_model`` is every in-place update's worker-side path; a model of a listed class
    (a stand-in module named like vLLM's: the check reads the class name) is refused before vLLM's
    reload starts, and the weights iterator is never read."""
    assert "GptOssForCausalLM" in STOCK_RELOAD_BROKEN_CPU
    stand_in = type("GptOssForCausalLM", (torch.nn.Module,), {})()

    def weights():
        raise AssertionError("read")
        yield

    with pytest.raises(InputError, match="in-place weight update refused") as e:
        load_into_model(None, stand_in, weights())
    assert e.value.field == "architectures"
    assert stock_reload_problem("MixtralForCausalLM") is None


def test_qwen2_head_dim_that_stock_vllm_ignores_is_refused():
    cfg = tiny_config("qwen2")                    # head_dim 64, hidden 128 / 4 heads = 32
    with pytest.raises(InputError, match="ignores head_dim=64") as e:
        check_stock_architecture(cfg)
    assert e.value.field == "head_dim"
    assert stock_config_problem(tiny_config("qwen2", num_attention_heads=2, num_key_value_heads=1)) is None
    assert stock_config_problem(dict(cfg, head_dim=None)) is None          # Qwen2.5's: unset
    assert stock_config_problem(tiny_config("llama")) is None              # vLLM's Llama reads it
