"""Old module paths, kept importable for one release after the layered layout.

`speculative.engine`, `speculative.config`, `speculative.serve.protocol`... moved into the
layer packages (core, policy, models, runtime, train, entrypoints). Rather than a shim file
per old module, one finder at the front of `sys.meta_path` answers for the old names: it
imports the module at its new place, so the old name is the very same module object, and
warns (DeprecationWarning) with the new path. Nothing is imported until an old name is.
Remove this file, and its two lines in `__init__.py`, in the release after next.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_LAYERS = {
    "core": ("config", "deprecation", "inputs", "rows", "sampling", "stats", "tree", "verify"),
    "policy": ("adaptive", "costs", "estimates", "tree_budget"),
    "models": ("kernels", "loading", "precision", "presets", "text"),
    "runtime": ("admission", "decoder", "engine", "phases"),
    "proposers": ("vocab",),
    "entrypoints": ("batch", "batch_command", "batch_files", "batch_ray", "bench", "bench_command", "bench_engine",
                    "bench_report", "cli", "cli_checks", "engine_args", "export", "prompt_files"),
}
# Old dotted module name -> new one.
MOVED = {f"speculative.{name}": f"speculative.{layer}.{name}" for layer, names in _LAYERS.items() for name in names}
MOVED["speculative.train.head_command"] = "speculative.entrypoints.train_head_command"
MOVED["speculative.train.vocab"] = "speculative.proposers.vocab"
# Packages moved whole: their modules follow them.
MOVED_PACKAGES = {"speculative.serve": "speculative.entrypoints.serve"}


def new_name(old: str) -> str | None:
    """Where the module once called `old` lives now; None if it did not move."""
    if old in MOVED:
        return MOVED[old]
    for package, new in MOVED_PACKAGES.items():
        if old == package or old.startswith(package + "."):
            return new + old[len(package):]
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new place."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(f"{spec.name} is now {self.new}; the old path goes in a later release", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        """The new module ran when it was imported; nothing is left to run."""

    def get_code(self, name):
        """`python -m speculative.cli` (the old path) runs the new module as __main__."""
        return compile(f"import runpy\nrunpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n",
                       f"<{name} is now {self.new}>", "exec")


class _OldPaths(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new = new_name(name)
        return None if new is None else importlib.util.spec_from_loader(name, _Alias(new))


def install() -> None:
    """Put the finder first on sys.meta_path, once: ahead of the path finder, which would
    otherwise load a second copy of a moved package's modules under the old name."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())


def old_submodule(package: str, name: str):
    """`speculative.engine` as an attribute, which `import speculative` used to provide."""
    if new_name(f"{package}.{name}") is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(f"{package}.{name}")
