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
