"""The import direction of docs/architecture.md, checked on the source: every `import` of every module,
function-level ones included. A new import across a layer fails here with the file and the line."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, Tuple

from launch import REPO

PACKAGE = REPO / "opencood_ddp"
BASE = {"errors", "atomic", "checkpoint_files", "numpy_yaml", "hypes", "registry", "yaml_parsers", "schema",
        "memory_fit", "numerics"}
PERCEPTION = {"data", "models", "loss", "postprocess", "metrics", "vis"}
# What each part of the package may import from opencood_ddp (besides itself). Keep in step with the picture
# in docs/architecture.md.
ALLOWED = {
    "errors": set(), "atomic": set(), "checkpoint_files": {"errors", "atomic"}, "numpy_yaml": set(),
    "hypes": {"errors", "atomic", "numpy_yaml"},
    "registry": {"errors", "hypes"},
    "yaml_parsers": {"errors", "hypes", "registry"}, "schema": {"errors", "hypes", "registry"},
    "memory_fit": {"errors"}, "numerics": set(),
    "distributed": {"errors", "atomic", "numerics"},
    "engine": BASE | {"distributed"},
    "data": BASE, "models": BASE, "loss": BASE, "vis": BASE,
    "postprocess": BASE | {"data"},
    "metrics": BASE | {"postprocess"},
    "toy": BASE | {"data"},
    "tasks": BASE | PERCEPTION | {"engine"},
}


def _part(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def _imports(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, dotted module) of every import in the file; relative imports resolved against the package."""
    package = ".".join(("opencood_ddp",) + path.relative_to(PACKAGE).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] if base == "opencood_ddp" else [base]
            for name in names:
                yield node.lineno, name


def test_every_module_imports_only_what_its_layer_may():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = _part(path)
        if part == "__init__":
            continue
        assert part in ALLOWED, f"{path}: a new part of the package; give it a row in ALLOWED and the docs"
        for line, module in _imports(path):
            if not module.startswith("opencood_ddp."):
                continue
            target = module.split(".")[1]
            if target != part and target not in ALLOWED[part]:
                wrong.append(f"{path.relative_to(REPO)}:{line} ({part}) imports {module}")
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


def _torch_distributed_uses(path: Path) -> Iterator[int]:
    """Lines that reach torch.distributed: its import in any spelling (`import torch.distributed as dist`,
    `from torch import distributed`, `from torch.distributed import ...`) and an attribute `torch.distributed` after
    a plain `import torch`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            if any(alias.name.startswith("torch.distributed") for alias in node.names):
                yield node.lineno
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if module.startswith("torch.distributed") or (
                    module == "torch" and any(alias.name == "distributed" for alias in node.names)):
                yield node.lineno
        elif (isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name)
              and node.value.id == "torch"):
            yield node.lineno


def test_the_perception_stack_never_calls_torch_distributed():
    found = [f"{path.relative_to(REPO)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if _part(path) in PERCEPTION | {"tasks", "toy"} for line in _torch_distributed_uses(path)]
    assert not found, found


def test_every_spelling_of_torch_distributed_is_seen(tmp_path):
    spellings = ["import torch.distributed as dist", "from torch import distributed",
                 "from torch import nn, distributed", "from torch.distributed import all_reduce",
                 "import torch\ntorch.distributed.all_reduce(x)"]
    for text in spellings:
        path = tmp_path / "m.py"
        path.write_text(text + "\n")
        assert list(_torch_distributed_uses(path)), text
    path.write_text("import torch\nfrom torch import nn\nimport torchvision.distributed\n")
    assert not list(_torch_distributed_uses(path))


def test_postprocess_reads_no_dataset():
    found = [f"{path.relative_to(REPO)}:{line}" for path in sorted((PACKAGE / "postprocess").rglob("*.py"))
             for line, module in _imports(path) if module.startswith("opencood_ddp.data.datasets")]
    assert not found, found


def test_the_engine_names_no_detection_word():
    """The engine passes the task's options through; detection words live in the task (issue 14's check)."""
    words = ("fusion_method", "save_vis", "ap_50", "pr_plot")
    found = [f"{path.relative_to(REPO)}:{number}" for path in sorted((PACKAGE / "engine").rglob("*.py"))
             for number, text in enumerate(path.read_text().splitlines(), 1) if any(w in text for w in words)]
    assert not found, found


def test_the_docs_picture_names_every_part_of_the_package():
    """docs/architecture.md's picture of the layers names every part of the package (tasks/ included), so that a
    new part cannot be left out of it."""
    text = (REPO / "docs" / "architecture.md").read_text()
    picture = text.split("## Three layers, one direction of imports", 1)[1].split("\n- ", 1)[0]
    named = set(re.findall(r"[a-z_]+", picture))
    assert set(ALLOWED) <= named, set(ALLOWED) - named
