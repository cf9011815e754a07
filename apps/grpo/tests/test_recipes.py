"""The shipped GPU recipes against the published shapes of their models.

Each model's config.json fields are written here (no download; a meta-device build checks them against
the published parameter count). For every recipe: the parallel layout against the heads, layers and
experts, the batch split over data-parallel ranks, the sequence budget (vLLM's max_model_len against the
packing budgets and the model's positions), and a per-GPU memory estimate on 80 GB H100s at the three
moments that peak with a colocated vLLM in the policy ranks (grpo_app.cluster, rollout.vllm_backend):

- start-up: the policy is built (bf16 params, fp32 grad buffer, fp32 main-param shard; Adam moments come
  with the first step) when vLLM starts, and vLLM refuses to start unless gpu_memory_utilization x total
  is still free;
- a training step: the full static state plus the activations of one packed micro-batch;
- the refit after it: the policy's grads and optimizer state are on the host and torch's cache is freed
  (grpo_app.colocation), so its weights, one gathered full tensor and vLLM's woken weights are on the GPU.

The estimates are back-of-envelope (bf16 activations of what backward keeps, no fragmentation beyond a
fixed reserve); they exist to catch a recipe that cannot fit, not to predict the peak to the GiB.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from grpo_app.config import CONFIG_DIR, GRPOConfig, load_config
from grpo_app.devices import Hardware
from rl_core.registry import ENGINES

GIB = 2**30
H100 = 79.1 * GIB  # what CUDA reports as the total memory of an 80 GB H100
CONTEXT = 1 * GIB  # CUDA context of the policy process, before anything is allocated
RESERVE = 4 * GIB  # context, NCCL buffers, allocator fragmentation: not available to tensors
VLLM_OVERHEAD = 2 * GIB  # vLLM's profiling activations and CUDA graphs, inside its own budget
GPU_MD = Path(__file__).resolve().parents[1] / "GPU.md"
NODE = Hardware(cuda_available=True, bf16_supported=True, num_gpus=8)

# From each model's config.json on the Hugging Face hub; `params`: the published size (meta-checked below).
SHAPES: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B-Instruct": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, tie_word_embeddings=False, params=8.03e9),
    "Llama-3.3-70B-Instruct": dict(
        model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, tie_word_embeddings=False, params=70.55e9),
    "Qwen2.5-7B-Instruct": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
        tie_word_embeddings=False, params=7.62e9),
    "Qwen3-8B": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, tie_word_embeddings=False, params=8.19e9),
    "Qwen3-32B": dict(
        model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, tie_word_embeddings=False, params=32.76e9),
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], params=30.53e9),
}


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder-only transformer that the layout and memory depend on."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    tied: bool
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0

    @classmethod
    def of(cls, name: str) -> Shape:
        c = SHAPES[name]
        return cls(hidden=c["hidden_size"], ffn=c["intermediate_size"], layers=c["num_hidden_layers"],
                   heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"],
                   head_dim=c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
                   vocab=c["vocab_size"], max_positions=c["max_position_embeddings"], tied=c["tie_word_embeddings"],
                   experts=c.get("num_experts", 0), topk=c.get("num_experts_per_tok", 0),
                   moe_ffn=c.get("moe_intermediate_size", 0))

    @property
    def layer_dense(self) -> int:
        """Parameters of one decoder layer outside the experts (attention, dense MLP or router)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = self.hidden * self.experts if self.experts else 3 * self.hidden * self.ffn
        return 2 * self.hidden * q + 2 * self.hidden * kv + mlp

    @property
    def layer_experts(self) -> int:
        return self.experts * 3 * self.hidden * self.moe_ffn

    @property
    def embed(self) -> int:
        return self.vocab * self.hidden

    @property
    def head(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def total(self) -> int:
        return self.layers * (self.layer_dense + self.layer_experts) + self.embed + self.head

    def activation_bytes(self, tokens: float, full_recompute: bool) -> float:
        """bf16 bytes backward keeps for `tokens` tokens of every layer; with full recompute (or HF activation
        checkpointing) the layer inputs, plus one layer's worth while it is recomputed."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = 2 * self.hidden + q + 2 * kv + q  # norm in, qkv in, q/k/v, attention out
        if self.experts:  # norm in, router in; per routed copy: fc1 in, fc1 out (gate, up), act out, fc2 out
            mlp = 2 * self.hidden + self.topk * (2 * self.hidden + 3 * self.moe_ffn)
        else:  # norm in, gate/up in, gate and up out, act out
            mlp = 2 * self.hidden + 3 * self.ffn
        per_layer = 2 * (attention + mlp) * tokens
        if full_recompute:
            return self.layers * 2 * self.hidden * tokens + per_layer
        return self.layers * per_layer

    def kv_bytes_per_token(self, tp: int) -> int:
        """vLLM's bf16 KV cache per token on one rank of a `tp`-way replica (KV heads replicated past tp)."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * 2


@dataclass(frozen=True)
class Layout:
    engine: str
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    full_recompute: bool
    world: int

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)


def gpu_recipes() -> list[Path]:
    """The shipped recipes that train a real model from a local directory (gpu_base is their shared part)."""
    out = []
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        name = load_config(path, hardware=NODE).policy.model_name
        if name.startswith("/") and "CHANGE-ME" not in name:
            out.append(path)
    return out


RECIPES = gpu_recipes()


@cache
def recipe(path: Path) -> tuple[GRPOConfig, Layout, Shape]:
    cfg = load_config(path, hardware=NODE)
    engine_cfg = ENGINES.get(cfg.policy.engine_name, config_key="policy").validate_config(cfg.policy)
    world = cfg.cluster.train_world_size
    if cfg.policy.engine_name == "megatron":
        ac = engine_cfg.activation_checkpointing
        layout = Layout("megatron", engine_cfg.tp, engine_cfg.pp, engine_cfg.cp, engine_cfg.ep, engine_cfg.etp,
                        ac.enabled and ac.granularity == "full", world)
    else:
        layout = Layout("dtensor", engine_cfg.tensor_parallel_size, 1, 1, 1, 1, engine_cfg.activation_checkpointing,
                        world)
    return cfg, layout, Shape.of(Path(cfg.policy.model_name).name)


def vllm_kwargs(cfg: GRPOConfig) -> tuple[int, float, int | None]:
    kwargs = cfg.generation.backend_kwargs
    return int(kwargs.get("tensor_parallel_size", 1)), float(kwargs.get("gpu_memory_utilization", 0.5)), \
        kwargs.get("max_model_len")


def test_declared_shapes_match_the_published_models():
    """The shapes above build (meta device) into models of the published size; the analytic count agrees."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for name, fields in SHAPES.items():
        kwargs = {k: v for k, v in fields.items() if k not in ("model_type", "params")}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields["model_type"], **kwargs))
        built = sum(p.numel() for p in model.parameters())
        assert abs(built - fields["params"]) / fields["params"] < 0.005, (name, built)
        assert abs(Shape.of(name).total - built) / built < 0.005, (name, Shape.of(name).total, built)


def test_every_gpu_recipe_declares_its_model_shape():
    assert len(RECIPES) >= 7
    for path in RECIPES:
        cfg = load_config(path, hardware=NODE)
        assert Path(cfg.policy.model_name).name in SHAPES, f"{path.name}: add {cfg.policy.model_name}'s shape"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_parallel_layout_fits_the_model_and_the_cluster(path):
    cfg, lay, s = recipe(path)
    gpus = cfg.cluster.gpus_per_node * cfg.cluster.num_nodes
    assert cfg.generation.colocated and lay.world == gpus, f"{path.name}: {lay.world} policy ranks on {gpus} GPUs"
    assert lay.world % (lay.tp * lay.pp * lay.cp) == 0
    assert s.heads % lay.tp == 0 and s.kv_heads % lay.tp == 0, f"{path.name}: TP={lay.tp} vs heads {s.heads}/{s.kv_heads}"
    assert s.layers % lay.pp == 0, f"{path.name}: PP={lay.pp} vs {s.layers} layers"
    if lay.ep > 1 or lay.etp != lay.tp:
        assert s.experts and s.experts % lay.ep == 0, f"{path.name}: EP={lay.ep} vs {s.experts} experts"
        assert (lay.dp * lay.cp * lay.tp) % (lay.ep * lay.etp) == 0, f"{path.name}: EP x ETP vs DP x CP x TP"
    # every data-parallel rank gets the same number of sequences of each optimizer step
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    assert samples % cfg.policy.train_global_batch_size == 0
    assert cfg.policy.train_global_batch_size % lay.dp == 0, f"{path.name}: global batch vs DP={lay.dp}"
    # vLLM inside the policy ranks: a replica is gen_tp consecutive ranks, inside one node
    gen_tp, _, _ = vllm_kwargs(cfg)
    assert cfg.generation.in_policy_workers
    assert lay.world % gen_tp == 0 and cfg.cluster.gpus_per_node % gen_tp == 0, f"{path.name}: vLLM TP={gen_tp}"
    assert s.heads % gen_tp == 0 and (s.kv_heads % gen_tp == 0 or gen_tp % s.kv_heads == 0), f"{path.name}: vLLM TP"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_sequence_budget(path):
    """vLLM's max_model_len bounds prompt + completion: it must leave room for the completion, stay within the
    model's positions, and every sequence it allows must fit one packed micro-batch (else seqpack raises
    mid-run) after padding to 2 x CP x TP."""
    cfg, lay, s = recipe(path)
    _, _, max_len = vllm_kwargs(cfg)
    assert max_len is not None, f"{path.name}: set generation.backend_kwargs.max_model_len (vLLM would size for " \
                                f"{s.max_positions} tokens)"
    assert cfg.generation.max_new_tokens + 256 <= max_len <= s.max_positions, path.name
    packing = cfg.policy.sequence_packing
    assert packing.enabled, path.name
    multiple = 2 * lay.cp * lay.tp if lay.engine == "megatron" and lay.cp * lay.tp > 1 else 1
    padded = math.ceil(max_len / multiple) * multiple
    assert padded <= packing.train_mb_tokens and padded <= packing.logprob_mb_tokens, path.name
    assert packing.train_mb_tokens % multiple == 0, path.name


def memory(path: Path) -> dict[str, float]:
    """Bytes per GPU: `init` (policy built, before vLLM starts), `train` (peak of a step), `refit` (the policy's
    part of the refit), `vllm_weights`."""
    cfg, lay, s = recipe(path)
    tokens = cfg.policy.sequence_packing.train_mb_tokens / lay.cp  # one packed micro-batch, this rank's share
    chunk = cfg.policy.logprob_chunk_tokens
    if lay.engine == "megatron":
        stage_layers = s.layers // lay.pp
        ends = s.embed + s.head if lay.pp == 1 else max(s.embed, s.head)  # first / last stage
        dense = (stage_layers * s.layer_dense + ends) / lay.tp
        experts = stage_layers * s.layer_experts / (lay.ep * lay.etp)
        expert_dp = lay.dp * lay.cp * lay.tp // (lay.ep * lay.etp)
        # bf16 params + fp32 grad buffer (engine default grad_reduce_in_fp32) on every rank; the distributed
        # optimizer's fp32 main params and Adam moments sharded over DP x CP (experts: expert-DP)
        main = 4 * (dense / (lay.dp * lay.cp) + experts / expert_dp)
        init = 6 * (dense + experts) + main
        weights = 2 * (dense + experts)
        static = 6 * (dense + experts) + 3 * main
        sp = lay.tp if lay.tp > 1 else 1  # sequence parallel: per-token tensors split over TP
        shape = Shape(**{**s.__dict__, "layers": stage_layers})
        activations = shape.activation_bytes(tokens / sp, lay.full_recompute) * lay.pp  # 1F1B: PP in flight
    else:  # FSDP2 over all ranks: fp32 params, grads and AdamW moments sharded; compute in bf16
        init = weights = 4 * s.total / lay.world
        static = 16 * s.total / lay.world
        per_layer = s.layer_dense + s.layer_experts
        static += 2 * 2 * per_layer + 4 * per_layer + 6 * (s.embed + s.head)  # gathered layers, their fp32 grads
        activations = s.activation_bytes(tokens, lay.full_recompute)
    logits = tokens * s.vocab / lay.tp * (2 + 2) + chunk * s.vocab / lay.tp * 4 * 3  # bf16 + grad, fp32 chunks
    gen_tp, _, _ = vllm_kwargs(cfg)
    return {"init": init, "train": static + activations + logits, "vllm_weights": 2 * s.total / gen_tp,
            "refit": weights + 4 * max(s.embed, s.head)}  # the largest gathered tensor, fp32 at most


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_memory_fits_an_80gb_h100(path):
    cfg, _, s = recipe(path)
    gen_tp, util, max_len = vllm_kwargs(cfg)
    m = memory(path)
    gib = {k: round(v / GIB, 1) for k, v in m.items()}
    # vLLM starts next to the built policy: its share must still be free
    assert m["init"] + util * H100 <= H100 - CONTEXT, f"{path.name}: vLLM cannot start ({gib}, util {util})"
    # ... and hold one max_model_len sequence (vLLM's own start-up check) besides its weights
    kv = util * H100 - m["vllm_weights"] - VLLM_OVERHEAD
    need = s.kv_bytes_per_token(gen_tp) * (max_len or s.max_positions)
    assert kv >= need, f"{path.name}: vLLM KV cache {kv / GIB:.1f} GiB < {need / GIB:.1f} GiB for one sequence"
    assert m["train"] <= H100 - RESERVE, f"{path.name}: a training step needs {gib}"
    assert m["refit"] + m["vllm_weights"] <= H100 - RESERVE, f"{path.name}: the refit needs {gib}"


def test_gpu_md_lists_every_recipe_with_its_gpu_count():
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+\.yaml)` \|.*\| (\d+) \|$", GPU_MD.read_text(),
                                                         re.MULTILINE)}
    for path in RECIPES:
        cfg, lay, _ = recipe(path)
        assert path.name in rows, f"GPU.md's recipe table lacks {path.name}"
        assert int(rows[path.name]) == cfg.cluster.gpus_per_node * cfg.cluster.num_nodes, path.name
        layout = GPU_MD.read_text().split(f"`{path.name}`", 1)[1].split("\n", 1)[0]
        if lay.engine == "megatron":
            for name, size in (("TP", lay.tp), ("PP", lay.pp), ("CP", lay.cp), ("EP", lay.ep), ("DP", lay.dp)):
                written = re.search(rf"\b{name} ?(\d+)", layout)
                assert (int(written.group(1)) if written else 1) == size, f"GPU.md: {path.name} {name}={size}"
