"""`doctor --model DIR` checks a user's checkpoint before any engine starts; these are the checks of
the weight files against themselves and against config.json (headers only, nothing loaded): a
truncated or malformed safetensors file, a sharded index naming a missing shard, an embedding
or lm-head whose shape disagrees with the config, a layer count the weights do not have, and
config numbers that cannot be right. Each is the project's error naming the file or field."""
import json
import shutil

import pytest
import torch

pytest.importorskip("vllm")  # inspect_checkpoint reads vLLM's model registry (no engine)

from skyrl_numerics.errors import InputError  # noqa: E402
from skyrl_numerics.doctor.model_check import check_memory, inspect_checkpoint, load_prompts_file


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from skyrl_numerics.models import build_tiny_model

    return build_tiny_model("qwen3_moe", cache_dir=tmp_path_factory.mktemp("m"))


def _copy(tiny, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny, d)
    return d


def _edit_config(d, **kw):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kw)
    (d / "config.json").write_text(json.dumps(cfg))


def _resave(d, edit):
    from safetensors.torch import load_file, save_file

    t = load_file(str(d / "model.safetensors"))
    edit(t)
    save_file(t, str(d / "model.safetensors"))


def _header(d, header: bytes):
    raw = (d / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n:])


def _refused(d, *needles):
    with pytest.raises(InputError) as e:
        inspect_checkpoint(d, count_params=False)
    msg = str(e.value)
    assert "\n" not in msg and str(d) in msg, msg
    for n in needles:
        assert n in msg, msg
    return e.value


def test_the_tiny_checkpoint_passes(tiny):
    info = inspect_checkpoint(tiny, count_params=False)
    assert "model.embed_tokens.weight" in info.weight_names


def test_a_truncated_file_is_refused_naming_the_tensor(tiny, tmp_path):
    d = _copy(tiny, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    _refused(d, "model.safetensors", "truncated")


@pytest.mark.parametrize("header,needle", [
    (b"12345", "not an object"),
    (b"[1, 2]", "not an object"),
    (json.dumps({"w": {"dtype": "XX", "shape": [2], "data_offsets": [0, 8]}}).encode(), "'w'"),
    (json.dumps({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}).encode(), "'w'"),
    (json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode(), "needs 16"),
    (json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode() + b"\xff",
     "not JSON"),
])
def test_a_malformed_header_is_refused(tiny, tmp_path, header, needle):
    d = _copy(tiny, tmp_path)
    _header(d, header)
    _refused(d, "model.safetensors", needle)


@pytest.mark.parametrize("edit,needles", [
    (dict(vocab_size=1024), ["model.embed_tokens.weight", "[1024, 128]"]),
    (dict(hidden_size=256), ["model.embed_tokens.weight", "[512, 256]"]),
    (dict(num_hidden_layers=4), ["num_hidden_layers 4", "model.layers.2"]),
    (dict(num_hidden_layers=1), ["model.layers.1", "num_hidden_layers 1"]),
    (dict(num_hidden_layers=0), ["num_hidden_layers"]),
    (dict(rms_norm_eps=float("nan")), ["rms_norm_eps"]),
    (dict(intermediate_size=-1), ["intermediate_size"]),
])
def test_a_config_the_weights_disagree_with_is_refused(tiny, tmp_path, edit, needles):
    d = _copy(tiny, tmp_path)
    _edit_config(d, **edit)
    _refused(d, *needles)


def test_weights_of_the_wrong_dtype_or_missing_are_refused(tiny, tmp_path):
    d = _copy(tiny, tmp_path)
    _resave(d, lambda t: t.__setitem__("model.embed_tokens.weight",
                                       t["model.embed_tokens.weight"].to(torch.int32)))
    _refused(d, "model.embed_tokens.weight", "I32")
    d2 = tmp_path / "ck2"
    shutil.copytree(tiny, d2)
    _resave(d2, lambda t: t.pop("lm_head.weight"))        # the tiny config is untied
    _refused(d2, "lm_head.weight", "missing")


def test_a_sharded_index_must_match_its_shards(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(tiny, tmp_path)
    t = load_file(str(d / "model.safetensors"))
    names = sorted(t)
    half = len(names) // 2
    (d / "model.safetensors").unlink()
    save_file({k: t[k] for k in names[:half]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: t[k] for k in names[half:]}, str(d / "model-00002-of-00002.safetensors"))
    wm = {k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
          for i, k in enumerate(names)}
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": wm}))
    assert len(inspect_checkpoint(d, count_params=False).weight_names) == len(names)
    wm[names[0]] = "model-00003-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": wm}))
    _refused(d, "model.safetensors.index.json", "not in the directory")
    wm[names[0]] = "model-00002-of-00002.safetensors"          # exists, but not where it is
    index.write_text(json.dumps({"weight_map": wm}))
    _refused(d, names[0], "model-00001-of-00002.safetensors")
    index.write_text("{oops")
    _refused(d, "model.safetensors.index.json")


def test_check_memory_and_prompts_refuse_nonsense_arguments(tiny, tmp_path):
    info = inspect_checkpoint(tiny, count_params=False)
    info.params = 1000
    for bad in ("x", "int3", None):
        with pytest.raises(InputError, match="unsupported dtype"):
            check_memory(info, engine_dtype="bfloat16", trainer_dtype=bad, n_prompts=1,
                         seq_len=8, max_model_len=64, available=1 << 40)
    f = tmp_path / "p.jsonl"
    f.write_text("[1, 2]\n")
    for kw in (dict(max_tokens=0, max_model_len=64), dict(max_tokens=-100, max_model_len=64),
               dict(max_tokens=8, max_model_len="x")):
        with pytest.raises(InputError):
            load_prompts_file(f, info, **kw)
    # \v and \u2028 are not line breaks in jsonl: the error names the file's own line
    f.write_text("[1]\n[2]\u2028\n[1, 999]\n")
    with pytest.raises(InputError, match="line 2: not valid JSON"):
        load_prompts_file(f, info, max_tokens=8, max_model_len=64)
    f.write_text("[1]\x0b\n[1, 999]\n")
    with pytest.raises(InputError, match="line 1: not valid JSON"):
        load_prompts_file(f, info, max_tokens=8, max_model_len=64)
