"""rl_core.lora, the LoRA pieces both engines share, against independent computations (float64 merges, peft's own
config class and matching, torch's nn.Linear initialisation)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

from rl_core import lora
from rl_core.config import ConfigError, parse_config

LAYERS = [f"model.layers.{i}.{block}.{leaf}" for i in range(2)
          for block, leaves in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                ("mlp", ("gate_proj", "up_proj", "down_proj"))) for leaf in leaves]


@dataclass(kw_only=True)
class EngineLoRAConfig(lora.LoRAConfig):
    key: ClassVar[str] = "policy.some_engine_cfg.lora_cfg"


def test_errors_name_the_engines_key() -> None:
    with pytest.raises(ConfigError, match=r"policy\.some_engine_cfg\.lora_cfg\.dim must be >= 1"):
        EngineLoRAConfig(dim=0)
    with pytest.raises(ConfigError, match=r"did you mean 'policy\.some_engine_cfg\.lora_cfg\.alpha'"):
        parse_config(EngineLoRAConfig, {"alpah": 1.0}, EngineLoRAConfig.key)
    with pytest.raises(ConfigError, match=r"policy\.some_engine_cfg\.lora_cfg\.target_modules: \['qproj'\] match "
                                          r"no nn\.Linear in the decoder layers of Arch; use leaf names among "
                                          r"\['down_proj', .*'v_proj'\]"):
        lora.select_modules(LAYERS, EngineLoRAConfig(target_modules=["qproj"]), "Arch")
    assert EngineLoRAConfig(alpha=16.0, dim=4).scaling == 4.0


@pytest.mark.parametrize(("patterns", "expected"), [
    ({}, LAYERS),
    ({"target_modules": ["*.self_attn.*"], "exclude_modules": ["o_proj"]},
     [n for n in LAYERS if n.rsplit(".", 1)[1] in ("q_proj", "k_proj", "v_proj")]),
    ({"target_modules": ["q_proj"], "exclude_modules": ["model.layers.0.*"]}, ["model.layers.1.self_attn.q_proj"]),
])
def test_selection_and_peft_spelling_match_peft(patterns: dict, expected: list[str]) -> None:
    """peft's own matching of the written target_modules adapts exactly the selected modules."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    selected = lora.select_modules(LAYERS, lora.LoRAConfig(**patterns), "Arch")
    assert selected == expected
    config = lora.peft_adapter_config(lora.LoRAConfig(**patterns), "base", lora.peft_target_modules(selected, LAYERS))
    peft_config = LoraConfig(**{k: v for k, v in config.items() if k != "peft_type"})
    assert [n for n in LAYERS if check_target_module_exists(peft_config, n)] == expected


def test_init_is_nn_linears_default_and_merge_is_the_float64_sum() -> None:
    a = lora.init_lora_a((4, 24), torch.Generator().manual_seed(lora.INIT_SEED))
    torch.manual_seed(lora.INIT_SEED)  # the default CPU generator draws the same stream as a freshly seeded one
    assert torch.equal(a, nn.Linear(24, 4, bias=False).weight.detach())  # nn.Linear's default initialisation
    w, b = torch.randn(8, 24, dtype=torch.bfloat16), torch.randn(8, 4)
    merged = dict(lora.merge_named([("m.q.weight", w), ("m.k.weight", w)],
                                   {"m.q.lora_A.weight": a, "m.q.lora_B.weight": b}, 2.0))
    expected = (w.double() + 2.0 * (b.double() @ a.double())).to(torch.bfloat16)
    assert merged["m.q.weight"].dtype == torch.bfloat16 and torch.equal(merged["m.k.weight"], w)
    assert (merged["m.q.weight"].double() - expected.double()).abs().max() <= expected.double().abs().max() * 2 ** -8


def test_adapter_dir_is_peft_format(tmp_path) -> None:
    from safetensors.torch import load_file

    a, b = torch.ones(2, 3), torch.zeros(5, 2)
    names = lora.adapter_names("model.layers.0.self_attn.q_proj")
    lora.write_adapter_dir(tmp_path, zip(names, (a, b)), {"r": 2})
    saved = load_file(str(tmp_path / lora.ADAPTER_DIR / "adapter_model.safetensors"))
    assert sorted(saved) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert json.loads((tmp_path / lora.ADAPTER_DIR / "adapter_config.json").read_text()) == {"r": 2}


def test_reference_switches_the_adapters_off_for_the_block() -> None:
    modules = [nn.Module(), nn.Module()]
    for module in modules:
        module.adapter_enabled = True
    reference = lora.BaseModelReference(modules)
    with reference.swapped_in():
        assert [m.adapter_enabled for m in modules] == [False, False]
    assert [m.adapter_enabled for m in modules] == [True, True]


def _weights_dir(path, **tensors: torch.Tensor):
    """An HF-style directory: one safetensors file of `tensors` and a config.json (not a weight file)."""
    from safetensors.torch import save_file

    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def _flip_byte(file, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0xFF
    file.write_bytes(bytes(data))


def test_base_model_fingerprint_sees_names_sizes_headers_and_both_ends(tmp_path) -> None:
    """4 MiB of weights: a copy has the same fingerprint; a byte flipped within the data's first MiB, a renamed or a
    resized file, or another tensor name a different one. A byte in the middle is not read (the cost bound)."""
    import shutil

    base = _weights_dir(tmp_path / "base", w=torch.arange(1 << 20, dtype=torch.float32))
    fingerprint = lora.base_model_fingerprint(base)
    data_start = 8 + int.from_bytes((base / "model.safetensors").read_bytes()[:8], "little")

    copy = shutil.copytree(base, tmp_path / "copy")
    (copy / "config.json").write_text('{"other": 1}')  # not a weight file
    assert lora.base_model_fingerprint(copy) == fingerprint

    def changed(name: str, change) -> str:
        other = shutil.copytree(base, tmp_path / name)
        change(other)
        return lora.base_model_fingerprint(other)

    assert changed("first_mib", lambda d: _flip_byte(d / "model.safetensors", data_start + 1000)) != fingerprint
    assert changed("last_mib", lambda d: _flip_byte(d / "model.safetensors", -5)) != fingerprint
    assert changed("renamed", lambda d: (d / "model.safetensors").rename(d / "model-00001.safetensors")) != fingerprint
    resized = _weights_dir(tmp_path / "resized", w=torch.arange((1 << 20) + 1, dtype=torch.float32))
    assert lora.base_model_fingerprint(resized) != fingerprint
    renamed_tensor = _weights_dir(tmp_path / "renamed_tensor", v=torch.arange(1 << 20, dtype=torch.float32))
    assert lora.base_model_fingerprint(renamed_tensor) != fingerprint
    assert changed("middle", lambda d: _flip_byte(d / "model.safetensors", data_start + (2 << 20))) == fingerprint


def test_another_base_model_is_refused_naming_the_fix(tmp_path) -> None:
    base = _weights_dir(tmp_path / "base", w=torch.zeros(4))
    other = _weights_dir(tmp_path / "other", w=torch.ones(4))
    saved = lora.BaseModel.of(base)
    assert lora.BaseModel.from_dict(saved.to_dict()) == saved
    assert lora.checked_base_model(saved, None, "ckpt/step_3", "--base-model DIR") == saved
    with pytest.raises(ValueError, match=rf"LoRA checkpoint ckpt/step_3 was trained on the base model at {base} "
                                         rf".*, but the base directory this run uses, {other}, holds another model "
                                         r".*: point policy.model_name at the base the run was trained from"):
        saved.check(lora.BaseModel.of(other), "ckpt/step_3", "policy.model_name")
    with pytest.raises(ValueError, match=rf"the base model directory {tmp_path / 'gone'} of LoRA checkpoint "
                                         r"ckpt/step_3 does not exist .*: pass the directory of that base with "
                                         r"--base-model DIR"):
        lora.checked_base_model(saved, tmp_path / "gone", "ckpt/step_3", "--base-model DIR")
    with pytest.raises(ValueError, match="holds no weight file"):
        lora.base_model_fingerprint(tmp_path)
