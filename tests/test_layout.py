"""The package's layout: layers that import only downwards, units that read in one sitting,
and the old module paths still importable (with a warning) for one release."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import speculative

PACKAGE = Path(speculative.__file__).parent
# From the bottom up; a module may import from its own layer or a lower one.
LAYERS = ["core", "policy", "models", "proposers", "runtime", "train", "entrypoints"]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# Where each module of the flat layout went (written out here, not read from _aliases, so
# that a wrong table there fails here).
MOVED = {
    **{name: f"core.{name}" for name in
       ["config", "deprecation", "inputs", "rows", "sampling", "stats", "tree", "verify"]},
    **{name: f"policy.{name}" for name in ["adaptive", "costs", "estimates", "tree_budget"]},
    **{name: f"models.{name}" for name in ["kernels", "loading", "precision", "presets", "text"]},
    **{name: f"runtime.{name}" for name in ["admission", "decoder", "engine", "phases"]},
    "vocab": "proposers.vocab",
    "train.vocab": "proposers.vocab",
    **{name: f"entrypoints.{name}" for name in
       ["batch", "batch_command", "batch_files", "batch_ray", "bench", "bench_command", "bench_engine",
        "bench_report", "cli", "cli_checks", "engine_args", "export", "prompt_files"]},
    "train.head_command": "entrypoints.train_head_command",
    "serve": "entrypoints.serve",
    **{f"serve.{name}": f"entrypoints.serve.{name}" for name in
       ["app", "command", "engine_loop", "handlers", "http", "metrics", "protocol", "reply", "text_stream"]},
}


def modules() -> list[tuple[str, Path]]:
    """(dotted name, path) of every module of the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found.append((".".join(parts), path))
    return found


def imported(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of everything a module imports from `speculative`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "speculative":
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "speculative"]
    return found


def layer_of(name: str) -> int | None:
    """A module's layer, counted from the bottom; None for the package's face and _aliases."""
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_sits_in_a_layer():
    loose = [name for name, _ in modules() if layer_of(name) is None]
    assert sorted(loose) == ["speculative", "speculative._aliases"]


def test_imports_go_down_only():
    upward = []
    for name, path in modules():
        layer = layer_of(name)
        if layer is None:
            continue
        for line, target in imported(name, path):
            target_layer = layer_of(target)
            if target_layer is None or target_layer > layer:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} ({LAYERS[layer]}) imports {target}")
    assert not upward, "\n".join(upward)


def test_units_read_in_one_sitting():
    long = []
    for _, path in modules():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(PACKAGE)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_old_paths_are_the_new_modules_and_warn(old, new):
    new_module = importlib.import_module(f"speculative.{new}")
    assert not (PACKAGE / (old.replace(".", "/") + ".py")).exists()
    sys.modules.pop(f"speculative.{old}", None)  # imported earlier in this process: import it afresh
    with pytest.warns(DeprecationWarning, match=re.escape(f"speculative.{old} is now speculative.{new}")):
        old_module = importlib.import_module(f"speculative.{old}")
    assert old_module is new_module and old_module.__name__ == f"speculative.{new}"


def test_old_names_still_import_their_contents():
    for old in ("speculative.config", "speculative.serve", "speculative.serve.protocol"):
        sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning):
        from speculative.config import SpeculativeConfig
        from speculative.serve.protocol import GenerationRequest
    assert SpeculativeConfig is speculative.SpeculativeConfig
    assert GenerationRequest is importlib.import_module("speculative.entrypoints.serve.protocol").GenerationRequest


def test_old_submodules_are_attributes_of_the_package():
    assert speculative.sampling is importlib.import_module("speculative.core.sampling")
    with pytest.raises(AttributeError):
        speculative.no_such_module


def test_python_m_the_old_cli_path_still_runs():
    new = subprocess.run([sys.executable, "-m", "speculative.entrypoints.cli", "--help"], capture_output=True,
                         text=True, timeout=120)
    old = subprocess.run([sys.executable, "-m", "speculative.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert new.returncode == old.returncode == 0 and "generate" in new.stdout, new.stderr
    assert old.stdout == new.stdout
