"""Name -> class registries for training engines, generation backends and (rollout.environments) reward environments.

This is the one place backend names live. Packages announce their classes through Python entry points
(`rl_core.engines`, `rl_core.generation_backends` in their pyproject.toml), so installing a wheel is what
makes a backend available; `@register_engine("name")` registers a class defined in-process (tests, a
user's own engine driven in that process, e.g. under torchrun; a launcher's worker processes, such as the
trainer's, know entry points only). An unknown name lists the known ones; a known but uninstalled one names the wheel.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from rl_core.config import PolicyConfig

C = TypeVar("C")


class Registry:
    def __init__(self, kind: str, group: str, wheels: dict[str, str], *, unknown_hint: str = "") -> None:
        self.kind, self.group, self.wheels = kind, group, wheels
        self.unknown_hint = unknown_hint  # appended to the message for a name nothing registers
        self._classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[type[C]], type[C]]:
        def decorate(cls: type[C]) -> type[C]:
            # one class per name: which of two would win depended on import order
            installed = self._entry_points().get(name)
            known = [self._classes[name]] if name in self._classes else []
            for other in [_path(c) for c in known] + ([installed.value] if installed is not None else []):
                if other != _path(cls):
                    raise ValueError(f"{self.kind} '{name}' is taken by {other}; register {_path(cls)} under "
                                     "another name")
            self._classes[name] = cls
            return cls

        return decorate

    def _entry_points(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for ep in entry_points(group=self.group):
            other = found.get(ep.name)
            if other is not None and other.value != ep.value:
                raise ValueError(f"{self.kind} '{ep.name}' is provided by two installed packages ({_dist(other)}: "
                                 f"{other.value}; {_dist(ep)}: {ep.value}); uninstall one of them")
            found[ep.name] = ep
        return found

    def in_process_only(self, name: str) -> bool:
        """`name` was registered by a decorator in this process and no installed entry point names it: other
        processes (a launcher's workers) that never import the registering module do not know it."""
        return name in self._classes and name not in self._entry_points()

    def names(self) -> list[str]:
        return sorted(set(self._classes) | set(self._entry_points()))

    def get(self, name: str, *, config_key: str) -> type:
        if name in self._classes:
            return self._classes[name]
        found = self._entry_points().get(name)
        if found is None:
            if name in self.wheels:
                raise ValueError(
                    f"{config_key} selects {self.kind} '{name}', which is not installed: "
                    f"pip install {self.wheels[name]}"
                )
            uninstalled = sorted(set(self.wheels) - set(self.names()))
            more = f" (or install {', '.join(self.wheels[n] for n in uninstalled)})" if uninstalled else ""
            more += f" ({self.unknown_hint})" if self.unknown_hint else ""
            raise ValueError(f"{config_key}: {self.kind} '{name}' is not registered; choose one of "
                             f"{self.names()}{more}")
        try:
            cls = found.load()
        except (ImportError, AttributeError) as exc:  # a missing module, or a module without the named class
            hint = f" (pip install {self.wheels[name]})" if name in self.wheels else ""
            raise ValueError(f"{self.kind} '{name}' is installed but failed to import{hint}: {exc}") from exc
        self._classes[name] = cls
        return cls


def _path(cls: type) -> str:
    """`module:qualname`, the spelling of an entry point's value."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _dist(ep: Any) -> str:
    return getattr(ep.dist, "name", None) or "an unnamed package"


ENGINES = Registry("training engine", "rl_core.engines", {"dtensor": "engine-dtensor", "megatron": "engine-megatron"})
GENERATION_BACKENDS = Registry(
    "generation backend", "rl_core.generation_backends", {"torch": "rl-rollout", "vllm": "'rl-rollout[vllm]'"}
)


def register_engine(name: str) -> Callable[[type[C]], type[C]]:
    return ENGINES.register(name)


def create_engine(policy: PolicyConfig, **kwargs: Any) -> Any:
    """Build the engine that `policy` selects (policy.engine, or policy.megatron_cfg/dtensor_cfg.enabled)."""
    cls = ENGINES.get(policy.engine_name, config_key=policy.engine_config_key)
    return cls(policy, **kwargs)


def register_generation_backend(name: str) -> Callable[[type[C]], type[C]]:
    return GENERATION_BACKENDS.register(name)


def create_generation_backend(name: str, **kwargs: Any) -> Any:
    """Build generation backend `name` (config key `generation.backend`)."""
    return GENERATION_BACKENDS.get(name, config_key="generation.backend")(**kwargs)
