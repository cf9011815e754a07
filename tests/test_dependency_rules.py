"""Architecture rules, checked on the source: import arrows, declared dependencies, names, sizes.

- Import arrows of DESIGN.md: rl-core imports no other package of ours; no engine imports the other;
  nothing imports the app.
- A wheel installs alone: every third-party module a package imports at module level is one of its
  declared dependencies (optional extras may only be imported inside functions).
- Backend names ("dtensor", "megatron", "vllm") appear only in the registry and config validation.
- No module over 800 lines (house rule 1).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "rl-core": ("rl_core", ROOT / "packages/rl-core"),
    "rl-seqpack": ("seqpack", ROOT / "packages/seqpack"),
    "engine-dtensor": ("engine_dtensor", ROOT / "packages/engine-dtensor"),
    "engine-megatron": ("engine_megatron", ROOT / "packages/engine-megatron"),
    "ckpt-convert": ("ckpt_convert", ROOT / "packages/ckpt-convert"),
    "rl-rollout": ("rollout", ROOT / "packages/rollout"),
}
OURS = {module: dist for dist, (module, _) in PACKAGES.items()} | {"grpo_app": "grpo-app"}
ALLOWED = {
    "rl-core": set(),
    "rl-seqpack": set(),
    "ckpt-convert": {"rl-core"},  # rl_core.checkpoint_io: atomic output, manifest check before DCP reads
    "rl-rollout": {"rl-core", "rl-seqpack"},  # seqpack.attention: packed prefill
    "engine-dtensor": {"rl-core", "rl-seqpack"},
    "engine-megatron": {"rl-core", "rl-seqpack", "ckpt-convert"},
}
# import name -> distribution name, where they differ
DIST_OF = {"megatron": "megatron-core", "yaml": "pyyaml", "math_verify": "math-verify", "google": "protobuf"}


def source_files(dist: str) -> list[Path]:
    module, root = PACKAGES[dist]
    return sorted((root / "src" / module).rglob("*.py"))


def imported_modules(nodes) -> set[str]:
    names = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import):
                names |= {alias.name.split(".")[0] for alias in sub.names}
            elif isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
                names.add(sub.module.split(".")[0])
    return names


def top_level_imports(path: Path) -> set[str]:
    """Modules imported at module level (not inside functions: those are lazy, allowed for extras)."""
    body = ast.parse(path.read_text()).body
    return imported_modules(n for n in body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))


def all_imports(path: Path) -> set[str]:
    return imported_modules([ast.parse(path.read_text())])


def declared(dist: str) -> set[str]:
    meta = tomllib.loads((PACKAGES[dist][1] / "pyproject.toml").read_text())["project"]
    return {re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower() for req in meta.get("dependencies", [])}


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_import_arrows(dist):
    for path in source_files(dist):
        for name in all_imports(path):
            if name in OURS and OURS[name] != dist:
                assert OURS[name] in ALLOWED[dist], f"{path.relative_to(ROOT)} imports {name}: not allowed for {dist}"


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_module_level_imports_are_declared_dependencies(dist):
    deps = declared(dist)
    stdlib = set(sys.stdlib_module_names)
    for path in source_files(dist):
        if "/testing/" in str(path):  # rl_core.testing needs the `testing` extra, imported lazily by users
            continue
        for name in top_level_imports(path) - stdlib - {"__future__", PACKAGES[dist][0]}:
            wanted = OURS.get(name) or DIST_OF.get(name, name.replace("_", "-"))
            assert wanted.lower() in deps, (
                f"{path.relative_to(ROOT)} imports {name} at module level but {dist} does not declare "
                f"{wanted}: declare it in packages/{dist}/pyproject.toml or import it lazily"
            )


def test_backend_names_live_only_in_registry_and_config():
    pattern = re.compile(r"""(==|!=)\s*["'](dtensor|megatron|vllm|torch)["']|__class__\.__name__""")
    allowed = {"registry.py", "config.py", "preflight.py"}
    offenders = []
    files = [p for dist in PACKAGES for p in source_files(dist)] + sorted((ROOT / "apps/grpo/grpo_app").rglob("*.py"))
    for path in files:
        if path.name in allowed:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "backend names compared outside the registry:\n" + "\n".join(offenders)


def test_no_module_over_800_lines():
    files = [p for p in ROOT.glob("packages/*/src/**/*.py")] + list(ROOT.glob("apps/grpo/**/*.py"))
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in files if (n := len(p.read_text().splitlines())) > 800]
    assert not long, "split these modules (house rule 1): " + ", ".join(long)
