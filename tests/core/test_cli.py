"""CLI: `gap FILE` on good and malformed dumps (exit 2, one line, nothing written)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from skyrl_numerics.cli import main
from skyrl_numerics.rollout import Rollout


def _dump(tmp_path, suffix=".jsonl"):
    rng = np.random.default_rng(0)
    lens = [5, 9, 3]
    prompts = [[1, 2, 3]] * 3
    responses = [rng.integers(0, 100, n).tolist() for n in lens]
    lp = [(-rng.random(n) * 3).astype(np.float32) for n in lens]
    tl = [x + rng.normal(0, 1e-3, len(x)).astype(np.float32) for x in lp]
    tl = [np.minimum(x, 0) for x in tl]
    return Rollout.from_lists(prompts, responses, lp, trainer_logprobs=tl,
                              engine="vllm (cpu)", engine_version="0.32.0").save(
        tmp_path / f"dump{suffix}")


@pytest.mark.parametrize("suffix", [".jsonl", ".safetensors"])
def test_gap_file_writes_report(tmp_path, suffix, capsys):
    f = _dump(tmp_path, suffix)
    out = tmp_path / "out"
    assert main(["gap", str(f), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mean |Δ|" in printed and "vllm (cpu)" in printed
    rep = json.loads((out / "report.json").read_text())
    assert rep["summary"]["n_tokens"] == 17
    assert (out / "gap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _rows(tmp_path, rows):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(json.dumps(r) if not isinstance(r, str) else r for r in rows) + "\n")
    return p


OK = {"prompt_ids": [1], "response_ids": [2, 3], "logprobs": [-1.0, -2.0],
      "trainer_logprobs": [-1.0, -2.1]}


@pytest.mark.parametrize("rows,expect", [
    ([OK, {**OK, "logprobs": [-1.0, float("nan")]}], "row 1, field 'logprobs', index 1"),
    ([OK, {**OK, "trainer_logprobs": [-1.0, 0.5]}], "row 1, field 'trainer_logprobs', index 1"),
    ([OK, {**OK, "trainer_logprobs": [-1.0]}], "row 1, field 'trainer_logprobs'"),
    ([OK, {**OK, "response_ids": [2]}], "row 1, field 'logprobs'"),
    ([], "no rows"),
    (['{"schema": "nope"}', OK], "schema"),
    ([{k: v for k, v in OK.items() if k != "trainer_logprobs"}], "no trainer logprobs"),
    ([OK, {"prompt_ids": [1], "response_ids": [2]}], "row 1, field 'logprobs'"),
])
def test_gap_malformed_exit_2_one_line_no_output(tmp_path, rows, expect, capsys):
    f = _rows(tmp_path, rows)
    out = tmp_path / "out"
    assert main(["gap", str(f), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert expect in err, err
    assert not out.exists()


def test_gap_missing_file(tmp_path, capsys):
    assert main(["gap", str(tmp_path / "nope.jsonl")]) == 2
    assert "file not found" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["modelopt_nvfp4", "ct_nvfp4", "ct_int4"])
def test_qat_check_cli_on_a_written_checkpoint(tmp_path, fmt, capsys):
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.quant import write_quantized_checkpoint

    src = build_tiny_model("qwen3_moe", cache_dir=tmp_path / "m", num_hidden_layers=1)
    out = tmp_path / f"q-{fmt}"
    names = write_quantized_checkpoint(src, out, fmt, lambda n: ".experts." in n)
    assert names
    rc = main(["qat-check", str(out), "--json", str(tmp_path / "r.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.startswith(f"qat-check {out}: OK")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["ok"] and rep["summary"]["tensors"] == len(names)


def test_qat_check_cli_refuses_a_nan_scale(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.quant import write_quantized_checkpoint

    src = build_tiny_model("qwen3_moe", cache_dir=tmp_path / "m", num_hidden_layers=1)
    out = tmp_path / "q"
    write_quantized_checkpoint(src, out, "modelopt_nvfp4", lambda n: ".experts.0." in n)
    f = next(out.glob("*.safetensors"))
    t = load_file(str(f))
    key = next(k for k in t if k.endswith("experts.0.down_proj.weight_scale"))
    s = t[key].view(torch.uint8).clone()
    s[0, 0] = 0x7F  # a NaN E4M3 block scale: bad input (issue 11), refused naming tensor and field
    t[key] = s.view(torch.float8_e4m3fn)
    save_file(t, str(f))
    capsys.readouterr()     # the model build's own progress lines
    rc = main(["qat-check", str(out)])
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, (cap.out, cap.err)
    assert "experts.0.down_proj.weight_scale" in lines[0] and "non-finite" in lines[0], lines
    assert cap.out == ""      # (finite scale edits: test_qat_check_cli_finite_scale_edits)


@pytest.mark.parametrize("edit", ["global_overflow", "block_scale_next"])
def test_qat_check_cli_finite_scale_edits(tmp_path, capsys, edit):
    """A scale changed to another *finite* value. Without --base, qat-check sees it only where the
    dequantized weights cannot re-encode (here: a global scale of 1e38 overflows bf16); a block
    scale moved to the next E4M3 value is a fixed point of dequantize -> re-encode and passes
    (docs/quant.md). --base recomputes codes and scales from the base weights and fails both,
    naming the tensor."""
    import torch
    from safetensors.torch import load_file, save_file

    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.quant import write_quantized_checkpoint

    src = build_tiny_model("qwen3_moe", cache_dir=tmp_path / "m", num_hidden_layers=1)
    out = tmp_path / "q"
    write_quantized_checkpoint(src, out, "modelopt_nvfp4", lambda n: ".experts.0." in n)
    f = next(out.glob("*.safetensors"))
    t = load_file(str(f))
    name = next(k for k in t if k.endswith("experts.0.down_proj.weight"))
    if edit == "global_overflow":
        t[name + "_scale_2"] = torch.full_like(t[name + "_scale_2"], 1e38)
    else:
        s = t[name + "_scale"].view(torch.uint8).clone()
        i = next(j for j in range(s.numel()) if 0 < int(s.view(-1)[j]) < 0x7E)
        s.view(-1)[i] += 1
        t[name + "_scale"] = s.view(torch.float8_e4m3fn)
    save_file(t, str(f))
    rc = main(["qat-check", str(out)])
    text = capsys.readouterr().out
    if edit == "global_overflow":
        assert rc == 1 and "MISMATCH" in text.splitlines()[0], text
        assert [ln.split()[0] for ln in text.splitlines()[1:] if "static DIFF" in ln] == [name], text
    else:
        assert rc == 0 and "OK" in text.splitlines()[0], text
    rc = main(["qat-check", str(out), "--base", str(src)])
    text = capsys.readouterr().out
    assert rc == 1 and name in text, text
