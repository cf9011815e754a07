"""Bad input gives a clear error naming the tensor/key and the fix, and writes nothing; the CLI works."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ckpt_convert.cli import main
from ckpt_convert.convert import convert_hf_to_mcore, convert_mcore_to_hf


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _assert_nothing_written(root: Path, keep: set) -> None:
    assert {p.name for p in root.iterdir()} == keep


def test_missing_tensor(tiny_ckpts: dict, tmp_path: Path) -> None:
    hf = _copy(tiny_ckpts["qwen2"], tmp_path / "hf")
    _rewrite_weights(hf, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*missing.*config\.json"):
        convert_hf_to_mcore(hf, tmp_path / "out")
    _assert_nothing_written(tmp_path, {"hf"})


def test_wrong_shape(tiny_ckpts: dict, tmp_path: Path) -> None:
    hf = _copy(tiny_ckpts["qwen3_moe"], tmp_path / "hf")

    def shrink(t: dict) -> None:
        t["model.layers.0.mlp.experts.2.up_proj.weight"] = t["model.layers.0.mlp.experts.2.up_proj.weight"][:64]

    _rewrite_weights(hf, shrink)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.2\.up_proj\.weight' has shape "
                                         r"\(64, 128\), expected \(128, 128\)"):
        convert_hf_to_mcore(hf, tmp_path / "out")
    _assert_nothing_written(tmp_path, {"hf"})


def test_unknown_tensor(tiny_ckpts: dict, tmp_path: Path) -> None:
    hf = _copy(tiny_ckpts["llama"], tmp_path / "hf")
    _rewrite_weights(hf, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": t["model.norm.weight"].clone()}))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight.*num_hidden_layers"):
        convert_hf_to_mcore(hf, tmp_path / "out")
    _assert_nothing_written(tmp_path, {"hf"})


def test_unknown_architecture(tiny_ckpts: dict, tmp_path: Path) -> None:
    hf = _copy(tiny_ckpts["llama"], tmp_path / "hf")
    cfg = (hf / "config.json").read_text().replace("LlamaForCausalLM", "GPTNeoXForCausalLM")
    (hf / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match=r"'GPTNeoXForCausalLM'.*supported: \['LlamaForCausalLM', "
                                         r"'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'MistralForCausalLM', "
                                         r"'MixtralForCausalLM', 'Qwen3MoeForCausalLM'\]"):
        convert_hf_to_mcore(hf, tmp_path / "out")
    _assert_nothing_written(tmp_path, {"hf"})


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors(damage: str, tiny_ckpts: dict, tmp_path: Path) -> None:
    hf = _copy(tiny_ckpts["mistral"], tmp_path / "hf")
    file = hf / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-1000] if damage == "truncate" else b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" + data)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file.*re-download"):
        convert_hf_to_mcore(hf, tmp_path / "out")
    _assert_nothing_written(tmp_path, {"hf"})


def test_tp_not_dividing_heads(tiny_ckpts: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_key_value_heads=2; choose --tp from \[1, 2\]"):
        convert_hf_to_mcore(tiny_ckpts["qwen3"], tmp_path / "out", tp=4)
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 4 experts; choose --ep from \[1, 2, 4\]"):
        convert_hf_to_mcore(tiny_ckpts["mixtral"], tmp_path / "out", ep=3)
    _assert_nothing_written(tmp_path, set())


def test_existing_output_is_refused(tiny_ckpts: dict, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="already exists; remove it or choose another --out"):
        convert_hf_to_mcore(tiny_ckpts["qwen2"], tmp_path / "out")


def test_output_that_appears_during_the_conversion_is_left_alone(tiny_ckpts: dict, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """--out is checked at the start; a directory created there meanwhile (another conversion, a user) is
    neither replaced nor mixed: an error, the temporary output removed."""
    from ckpt_convert import hf_io

    real_get = hf_io.HFSource.get

    def get_then_race(self, name):
        (tmp_path / "out").mkdir(exist_ok=True)
        (tmp_path / "out" / "mine.txt").write_text("keep")
        return real_get(self, name)

    monkeypatch.setattr(hf_io.HFSource, "get", get_then_race)
    with pytest.raises(FileExistsError, match="appeared while it was being written"):
        convert_hf_to_mcore(tiny_ckpts["qwen2"], tmp_path / "out")
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"
    _assert_nothing_written(tmp_path, {"out"})


def test_cli_errors_name_the_problem(tiny_ckpts: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["hf2mcore", "--hf", str(tiny_ckpts["qwen2"]), "--out", str(tmp_path / "o"), "--tp", "0"])
    assert "--tp: must be >= 1; got 0" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["hf2mcore", "--hf", str(tiny_ckpts["qwen2"]), "--out", str(tmp_path / "file" / "o")]) == 2
    assert "file" in capsys.readouterr().err  # an OSError naming the path, not a traceback
    broken = tmp_path / "broken"
    shutil.copytree(tiny_ckpts["qwen2"], broken)
    (broken / "config.json").write_text("{not json")
    assert main(["hf2mcore", "--hf", str(broken), "--out", str(tmp_path / "o2")]) == 2
    assert f"{broken / 'config.json'} is not valid JSON" in capsys.readouterr().err


def test_failure_midway_leaves_nothing(tiny_ckpts: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error while writing (after validation) removes the temporary directory."""
    from ckpt_convert import hf_io

    calls = {"n": 0}
    real_get = hf_io.HFSource.get

    def flaky_get(self, name):
        calls["n"] += 1
        if calls["n"] > 5:
            raise OSError("disk on fire")
        return real_get(self, name)

    monkeypatch.setattr(hf_io.HFSource, "get", flaky_get)
    with pytest.raises(OSError, match="disk on fire"):
        convert_hf_to_mcore(tiny_ckpts["qwen2"], tmp_path / "out")
    _assert_nothing_written(tmp_path, set())


def test_mcore2hf_needs_config(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    with pytest.raises(ValueError, match="not a megatron torch_dist checkpoint"):
        convert_mcore_to_hf(tmp_path / "ck", tmp_path / "out")


def test_mcore2hf_of_a_dcp_checkpoint_without_conversion_metadata_names_the_file(tmp_path: Path) -> None:
    """A DCP checkpoint that is not megatron's (the DTensor engine's `policy/`): the missing ckpt_convert.json is
    named with what --mcore must be, not an errno."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"model.lm_head.weight": torch.zeros(4, 2)}, checkpoint_id=str(tmp_path / "policy"))
    with pytest.raises(ValueError, match=r"policy/ckpt_convert.json not found: --mcore must be a checkpoint written"):
        convert_mcore_to_hf(tmp_path / "policy", tmp_path / "out")
    # the trainer's step_N around it: the checkpoint inside is named
    with pytest.raises(ValueError, match=rf"{tmp_path} is not a megatron torch_dist checkpoint \(no .metadata file\); "
                                         rf"the checkpoint inside is {tmp_path}/policy"):
        convert_mcore_to_hf(tmp_path, tmp_path / "out2")


def test_cli_roundtrip_and_error(tiny_ckpts: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["hf2mcore", "--hf", str(tiny_ckpts["qwen3"]), "--out", str(tmp_path / "m"), "--tp", "2",
                 "--dtype", "bf16"]) == 0
    assert main(["mcore2hf", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "h")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "m"), str(tmp_path / "h")]
    original, back = load_file(tiny_ckpts["qwen3"] / "model.safetensors"), load_file(tmp_path / "h" / "model.safetensors")
    assert all(back[k].dtype == original[k].bfloat16().dtype and back[k].equal(original[k].bfloat16())
               for k in original)
    assert '"dtype": "bfloat16"' in (tmp_path / "h" / "config.json").read_text()
    assert main(["hf2mcore", "--hf", str(tiny_ckpts["qwen3"]), "--out", str(tmp_path / "x"), "--tp", "3"]) == 2
    assert "tp=3 does not divide" in capsys.readouterr().err


def test_console_script_help() -> None:
    out = subprocess.run([sys.executable, "-m", "ckpt_convert.cli", "hf2mcore", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert all(flag in out for flag in ("--hf", "--out", "--tp", "--pp", "--ep", "--dtype"))


def test_the_cli_prints_its_result_not_megatrons_import_noise(tiny_ckpts: dict, tmp_path: Path) -> None:
    """megatron-core warns at import that it falls back without TE / apex, and torch's extension loader that it found
    no CUDA; a conversion's stderr is its own log line alone (without `megatron_noise.silence()` it is 14 lines)."""
    out = subprocess.run([sys.executable, "-m", "ckpt_convert.cli", "hf2mcore", "--hf", str(tiny_ckpts["llama"]),
                          "--out", str(tmp_path / "m")], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(tmp_path / "m")]
    assert [line for line in out.stderr.splitlines() if "Writing model shards" not in line] == [
        line for line in out.stderr.splitlines() if line.startswith("INFO ckpt_convert.convert: hf2mcore wrote")], \
        out.stderr


class _Payload:
    """Unpickling this runs `Path(marker).touch()`: what a crafted DCP `.metadata` could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_mcore2hf_verifies_the_manifest_before_unpickling_metadata(tiny_ckpts: dict, tmp_path: Path,
                                                                    capsys) -> None:
    import pickle

    mcore = convert_hf_to_mcore(tiny_ckpts["qwen2"], tmp_path / "mcore")
    assert (mcore / "MANIFEST.json").is_file()  # hf2mcore writes one, last
    marker = tmp_path / "payload-ran"
    size = (mcore / ".metadata").stat().st_size
    crafted = pickle.dumps(_Payload(marker))
    (mcore / ".metadata").write_bytes(crafted.ljust(size, b"\0"))  # same size: only the sha256 can tell
    assert main(["mcore2hf", "--mcore", str(mcore), "--out", str(tmp_path / "hf")]) == 2
    assert ".metadata does not match its sha256" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "hf").exists()
    pickle.loads(crafted)  # the payload is real: unpickled unchecked, it runs
    assert marker.exists()


def test_default_dtype_keeps_the_checkpoints(tmp_path: Path) -> None:
    """A bf16 checkpoint round-trips as bf16 without --dtype (it came back fp32: twice the size)."""
    import torch

    from rl_core.testing.tiny_models import build_tiny_model, build_tokenizer

    build_tiny_model("qwen3", dtype=torch.bfloat16, vocab_size=100).save_pretrained(tmp_path / "hf")
    build_tokenizer().save_pretrained(tmp_path / "hf")
    assert main(["hf2mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m")]) == 0
    assert main(["mcore2hf", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "back")]) == 0
    source, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert source.keys() == back.keys() and all(back[k].dtype == torch.bfloat16 and back[k].equal(source[k])
                                                  for k in source)


def test_cli_hub_id_says_nothing_is_downloaded(tmp_path: Path, capsys: pytest.CaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`--hf Qwen/Qwen3-0.6B` (a Hub id, as a new user may try) is no local directory: the error says to fetch it."""
    monkeypatch.chdir(tmp_path)
    assert main(["hf2mcore", "--hf", "Qwen/Qwen3-0.6B", "--out", "q"]) == 2
    err = capsys.readouterr().err
    assert "no directory Qwen/Qwen3-0.6B here, and nothing is downloaded: fetch a Hugging Face Hub model first" in err
    assert main(["hf2mcore", "--hf", str(tmp_path), "--out", "q"]) == 2  # a directory without config.json
    assert "nothing is downloaded" not in capsys.readouterr().err and not (tmp_path / "q").exists()
