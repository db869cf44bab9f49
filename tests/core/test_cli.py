"""CLI: `gap FILE` on good and malformed dumps (exit 2, one line, nothing written)."""
from __future__ import annotations

import json
from pathlib import Path

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


@pytest.mark.parametrize("fmt", ["modelopt_nvfp4", "ct_int4"])
@pytest.mark.parametrize("config", ["{not json", "[1, 2]"])
def test_qat_check_cli_refuses_a_corrupt_config_without_base(tmp_path, fmt, config, capsys):
    """Without --base the INT4 group size is read from config.json: a config.json that is not
    a JSON object used to be ignored silently (a normal report, exit 0)."""
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.quant import write_quantized_checkpoint

    src = build_tiny_model("qwen3_moe", cache_dir=tmp_path / "m", num_hidden_layers=1)
    out = tmp_path / f"q-{fmt}"
    write_quantized_checkpoint(src, out, fmt, lambda n: ".experts." in n)
    (out / "config.json").write_text(config)
    capsys.readouterr()                          # (the writer's own output)
    assert main(["qat-check", str(out), "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json" in err, err
    assert not (tmp_path / "r.json").exists()


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


# ---- --out that cannot take the report, and texts that are not markup ----------------------
def _one_line_error(capsys) -> str:
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert cap.out == "", cap.out              # refused before anything is printed
    return err


@pytest.mark.parametrize("case", ["out_is_a_file", "out_below_a_file", "png_is_a_dir",
                                  "json_is_a_dir"])
def test_gap_out_that_cannot_take_the_report_exits_2_before_any_work(tmp_path, case, capsys):
    f = _dump(tmp_path)
    blocker = tmp_path / "a_file[x]"              # (brackets: printed as they are, not escaped)
    blocker.write_text("x")
    out = {"out_is_a_file": blocker, "out_below_a_file": blocker / "sub"}.get(case, tmp_path / "out")
    if case == "png_is_a_dir":
        (out / "gap.png").mkdir(parents=True)
    if case == "json_is_a_dir":
        (out / "report.json").mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["gap", str(f), "--out", str(out)]) == 2
    err = _one_line_error(capsys)
    assert "--out" in err and str(out) in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before   # nothing written


def test_gap_report_files_are_written_together_or_not_at_all(tmp_path, monkeypatch):
    """The PNG failing after report.json was rendered leaves neither (nor a temp file), and
    the error is the project's, naming --out."""
    from skyrl_numerics.doctor import report
    from skyrl_numerics.errors import InputError

    def broken_plot(path, rows, title):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(report, "write_plot", broken_plot)
    out = tmp_path / "out"
    with pytest.raises(InputError, match="No space left"):
        report.write_files(out, {"report.json": lambda p: report.write_json(p, {"a": 1}),
                                 "gap.png": lambda p: report.write_plot(p, [], "t")})
    assert not out.exists()
    out.mkdir()
    (out / "report.json").write_text("old")
    with pytest.raises(InputError):
        report.write_files(out, {"report.json": lambda p: report.write_json(p, {"a": 1}),
                                 "gap.png": lambda p: report.write_plot(p, [], "t")})
    assert [p.name for p in out.iterdir()] == ["report.json"]
    assert (out / "report.json").read_text() == "old"            # the old report kept whole


@pytest.mark.parametrize("engine", ["[/bold]", "[red]x[/red]", "\ud800", "a\\[b]", "$x", "cost $5 $"])
def test_gap_prints_engine_names_and_paths_verbatim(tmp_path, engine, capsys, monkeypatch):
    """A name or path from the user's data is printed as text: rich markup in it is not
    interpreted (``[/bold]`` used to crash the table, ``[bold]`` to vanish), a lone surrogate becomes an escape.
    Relative paths: the table title wraps at the table's width, and a long temp path (an xdist
    worker's) would wrap it inside the name."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(1)
    lp = [(-rng.random(4)).astype(np.float32)]
    d = Path("run[bold]x")
    d.mkdir()
    f = Rollout.from_lists([[1, 2]], [[3, 4, 5, 6]], lp, trainer_logprobs=lp,
                           engine=engine).save(d / "dump.jsonl")
    out = Path("o[red]y")
    assert main(["gap", str(f), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    shown = engine.encode("utf-8", "backslashreplace").decode()
    assert shown in printed and "run[bold]x" in printed and "o[red]y" in printed
    assert json.loads((out / "report.json").read_text())["engine"] == engine


def test_gap_of_a_huge_but_valid_gap_reports_inf(tmp_path, capsys):
    """Logprobs can be finite and still 1000 nats apart: the ratios are infinite, reported as
    such (the table shows '-'), not an OverflowError."""
    f = Rollout.from_lists([[1, 2]], [[3, 4]], [[-1000.0, -0.2]],
                           trainer_logprobs=[[-0.1, -0.2]]).save(tmp_path / "big.safetensors")
    assert main(["gap", str(f), "--out", str(tmp_path / "o")]) == 0
    cap = capsys.readouterr()
    assert cap.err == ""                        # no numpy overflow warnings either
    rep = json.loads((tmp_path / "o" / "report.json").read_text())["summary"]
    assert rep["ratio_max"] == float("inf") and rep["max_abs"] == pytest.approx(999.9, rel=1e-6)


def test_gap_error_from_the_values_names_the_file(tmp_path, capsys):
    f = Rollout.from_lists([[1], [1]], [[], []], [[], []], trainer_logprobs=[[], []]).save(
        tmp_path / "empty.jsonl")
    assert main(["gap", str(f)]) == 2
    assert str(f) in _one_line_error(capsys)


@pytest.mark.parametrize("what", ["missing", "a_file", "empty_dir"])
def test_qat_check_cli_names_what_is_wrong_with_the_directory(tmp_path, what, capsys):
    d = tmp_path / "q"
    if what == "a_file":
        d.write_text("x")
    if what == "empty_dir":
        d.mkdir()
    assert main(["qat-check", str(d)]) == 2
    err = capsys.readouterr().err.strip()
    expect = {"missing": "not found", "a_file": "not a directory", "empty_dir": "no *.safetensors"}[what]
    assert len(err.splitlines()) == 1 and expect in err and str(d) in err, err


@pytest.mark.parametrize("cmd", ["doctor", "train", "trace"])
def test_family_takes_every_tiny_model_and_refuses_others_in_one_line(cmd, capsys):
    """``--family`` is every family ``models.build_tiny_model`` builds (the commands then treat it
    as ``--model`` on that directory); anything else exits 2 naming the choices."""
    from skyrl_numerics.cli import build_parser
    from skyrl_numerics.models import FAMILIES, tiny_config

    parser = build_parser()
    for family in FAMILIES:
        tiny_config(family)                      # a tiny config exists for each
        assert parser.parse_args([cmd, "--family", family]).family == family
    with pytest.raises(SystemExit) as e:
        main([cmd, "--family", "no_such_family"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'no_such_family'" in err and "glm4_moe" in err
