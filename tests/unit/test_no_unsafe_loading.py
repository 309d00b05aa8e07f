"""No code path that turns bytes into executable objects: an AST scan of the product code.

Wire data and stored blobs are msgpack and raw tensor bytes, weights are safetensors (design
§5). This scans every module of broker/, services/, workers/ and models/ for what would break
that: pickle and its relatives (dill, cloudpickle, joblib, marshal, shelve), `torch.load`
without `weights_only=True`, TorchScript loading, `numpy.load(allow_pickle=True)`, unsafe
YAML loading, and the `eval` / `exec` / `compile` builtins. The scanner is checked on
snippets first, so a silent scanner cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("broker", "services", "workers", "models")
BANNED_MODULES = frozenset(
    {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
)
BANNED_BUILTINS = frozenset({"eval", "exec", "compile", "__import__"})
# Dotted calls that deserialise code whatever their arguments.
BANNED_CALLS = frozenset(
    {
        "torch.jit.load",
        "torch.package.PackageImporter",
        "pandas.read_pickle",
        "yaml.unsafe_load",
        "yaml.full_load",
        "yaml.load_all",
        "numpy.lib.format.read_array",
    }
)


class Scanner(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}  # local name -> dotted origin
        self.found: list[str] = []

    def flag(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{self.path}:{getattr(node, 'lineno', 0)}: {what}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in BANNED_MODULES:
                self.flag(node, f"import {alias.name}")
            self.aliases[alias.asname or alias.name.split(".")[0]] = (
                alias.name if alias.asname else alias.name.split(".")[0]
            )

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if module.split(".")[0] in BANNED_MODULES:
            self.flag(node, f"from {module} import ...")
        for alias in node.names:
            self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}"

    def dotted(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        if isinstance(node.func, ast.Name) and node.func.id in BANNED_BUILTINS:
            if node.func.id not in self.aliases:  # the builtin, not an import of that name
                self.flag(node, f"{node.func.id}()")
        if name is not None:
            name = name.replace("np.", "numpy.", 1) if name.startswith("np.") else name
            if name in BANNED_CALLS:
                self.flag(node, f"{name}()")
            if name == "torch.load" and not _is_true(keywords.get("weights_only")):
                self.flag(node, "torch.load() without weights_only=True")
            if name == "numpy.load" and not _is_false(keywords.get("allow_pickle", False)):
                self.flag(node, "numpy.load(allow_pickle=...) not False")
            if name == "yaml.load" and not _safe_loader(keywords.get("Loader")):
                self.flag(node, "yaml.load() without SafeLoader")
        self.generic_visit(node)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _is_false(node: ast.expr | bool | None) -> bool:
    return node is False or (isinstance(node, ast.Constant) and node.value is False)


def _safe_loader(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Attribute | ast.Name) and "Safe" in ast.unparse(node)


def scan_source(source: str, path: str = "<snippet>") -> list[str]:
    scanner = Scanner(path)
    scanner.visit(ast.parse(source, path))
    return scanner.found


def product_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import cloudpickle as cp",
        "from marshal import loads",
        "import shelve",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.load(f, weights_only=False)",
        "from torch import load\nload(f)",
        "import torch as t\nt.load(f, map_location='cpu')",
        "import torch\ntorch.jit.load(f)",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "import yaml\nyaml.load(s)",
        "import yaml\nyaml.unsafe_load(s)",
        "eval(body)",
        "exec(code)",
        "compile(src, 'x', 'exec')",
        "import pandas as pd\npd.read_pickle(p)",
    ],
)
def test_the_scanner_finds_unsafe_loading(snippet: str) -> None:
    assert scan_source(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.load(f, weights_only=True)",
        "import numpy as np\nnp.load(f)\nnp.load(f, allow_pickle=False)",
        "model.eval()",
        "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)\nyaml.safe_load(s)",
        "from safetensors.torch import load\nload(b)",
        "import msgpack\nmsgpack.unpackb(b)",
    ],
)
def test_the_scanner_lets_safe_loading_pass(snippet: str) -> None:
    assert scan_source(snippet) == [], snippet


def test_no_product_module_deserialises_code() -> None:
    modules = product_modules()
    assert len(modules) > 100  # the packages were found
    found = [hit for path in modules for hit in scan_source(path.read_text(), str(path))]
    assert found == []
