"""The contracts every training engine, generation backend and reward environment implements.

Kept to one screen on purpose: optional abilities go in separate protocols, not here. The shared
contract tests in `rl_core.testing.contracts` run against every implementation.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: a reward environment implements these contracts without torch
    from torch import Tensor

    from rl_core.batch import LossFn, StepResult, TokenBatch


@runtime_checkable
class TrainingEngine(Protocol):
    """A sharded policy model that computes logprobs, takes loss gradients and steps its optimizer.

    Engines subclass it (inheriting the `train_batch` template); `abstractmethod` makes a missing method
    an error at construction instead of a silent `None` from the protocol's empty body.
    """

    dp_rank: int
    dp_size: int

    @abstractmethod
    def forward_backward(self, batch: TokenBatch, loss_fn: LossFn, *, forward_only: bool = False) -> StepResult:
        """Run every micro-batch of this rank's batch through `loss_fn`; accumulate grads unless forward_only."""

    @abstractmethod
    def compute_logprobs(self, batch: TokenBatch) -> list[Tensor]:
        """Per-sequence target-token logprobs (L_i,), 0 at position 0 (see rl_core.batch)."""

    @abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Clip grads, step optimizer and scheduler; skip the step if the grad norm is not finite. Either way
        the gradients are consumed: the next forward_backward starts from zero (no zero_grad needed)."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Drop accumulated gradients."""

    def train_batch(self, batch: TokenBatch, loss_fn: LossFn) -> dict[str, float]:
        """zero_grad + forward_backward + optimizer_step; returns loss, loss metrics and step metrics."""
        # The template (engines that subclass TrainingEngine inherit it): one definition of a training step.
        self.zero_grad()
        result = self.forward_backward(batch, loss_fn)
        step = self.optimizer_step()
        return {**result.metrics, "loss": result.loss, **step, "num_micro_batches": float(result.num_micro_batches)}

    @abstractmethod
    def export_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full (unsharded) tensors under Hugging Face names, one at a time (for refit)."""

    @abstractmethod
    def save_hf(self, path: str) -> None:
        """A Hugging Face model directory (config, safetensors, tokenizer files) at `path`; every rank calls it."""

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Write model, optimizer, scheduler and RNG state atomically to `path`."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore everything `save_checkpoint` wrote."""

    @abstractmethod
    def offload(self, *, keep_weights: bool = False) -> None:
        """Move parameters, grads and optimizer state to host memory and free the device's cached memory
        (colocated generation). `keep_weights`: the parameters stay, for the refit that reads them next
        (NeMo-RL's offload before refit); a later `offload()` moves them too."""

    @abstractmethod
    def onload(self) -> None:
        """Bring them back to the training device."""


@runtime_checkable
class ReferencePolicy(Protocol):
    """Optional for engines: the KL reference as a weights-only copy inside the policy engine."""

    def snapshot_reference(self) -> None:
        """Keep the current weights (this rank's shards, no grads, no optimizer state) as the reference."""

    def compute_ref_logprobs(self, batch: TokenBatch) -> list[Tensor]:
        """`compute_logprobs` under the reference weights."""


@runtime_checkable
class ValidatesConfig(Protocol):
    """Optional for engine classes: check the engine's config section before any worker starts."""

    @classmethod
    def validate_config(cls, policy: Any) -> Any:
        """Parse and check `policy`'s engine section; raise ConfigError naming the key on bad input."""


@runtime_checkable
class ChecksModel(Protocol):
    """Optional for engine classes: refuse a checkpoint the engine cannot train before any worker starts."""

    @classmethod
    def check_model(cls, policy: Any) -> None:
        """Raise ValueError if the engine cannot train `policy.model_name` (a local HF directory) with the settings
        of `policy` (e.g. an architecture it does not map, adapters on modules the model lacks), naming the fix."""


@runtime_checkable
class PadsSequences(Protocol):
    """Optional for engine classes: the multiple the engine pads a sequence to, known from the config alone
    (the trainer's prompt-length limit rounds by it, so that no admitted prompt fits no micro-batch)."""

    @classmethod
    def sequence_multiple(cls, policy: Any) -> int:
        """The `seq_multiple` the engine passes to `rl_core.config.micro_batch_limits` for `policy`."""


@runtime_checkable
class ExportsCheckpoint(Protocol):
    """Optional for engine classes: turn a `save_checkpoint` directory into a Hugging Face model directory
    offline (one process, no process group, CPU, weights only), without restarting the engine on its layout."""

    @classmethod
    def checkpoint_to_hf(cls, checkpoint_dir: str, out_dir: str, *, model_dir: str) -> None:
        """Write `out_dir` (must not exist) atomically; `model_dir` is the run's policy.model_name."""


@dataclass(kw_only=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 128
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None


@dataclass(kw_only=True)
class Completion:
    """One sampled continuation; `logprobs[i]` is the logprob of `token_ids[i]` under the sampler."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


@runtime_checkable
class GenerationBackend(Protocol):
    """Samples completions from the current policy weights."""

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """`params.n` completions per prompt, ordered prompt-major."""

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load new weights given under Hugging Face names (refit)."""

    def sleep(self) -> None:
        """Release the KV cache and, where possible, the weights' device memory."""

    def wake(self) -> None:
        """Undo `sleep`."""


@dataclass(kw_only=True)
class RewardRequest:
    prompt: str  # as the policy saw it (its chat template applied, where it has one)
    completion: str
    metadata: dict[str, Any] = field(default_factory=dict)
    # the prompt as chat messages (system prompt included), for an environment that renders the conversation its
    # own way: a reward model with a chat template of its own
    messages: list[dict[str, str]] = field(default_factory=list)
    # the generator's Completion.finish_reason: "stop" (a stop token ended it) or "length" (cut at max_new_tokens);
    # None where unknown. Decoding drops special tokens, so only this tells a completion that stopped from one
    # that ran on in <pad> or <s> tokens, which a reward on the text's length alone pays for not stopping
    finish_reason: str | None = None


@dataclass(kw_only=True)
class RewardResult:
    reward: float
    correct: bool | None = None  # for accuracy metrics, where the task has a notion of correct
    error: str | None = None  # set when scoring crashed or timed out (reward is then 0)


@runtime_checkable
class Environment(Protocol):
    """Turns completions into rewards."""

    def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """One result per request, in order."""
