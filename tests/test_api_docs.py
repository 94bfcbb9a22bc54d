"""The documentation says what the code has: every public name is in the API reference, every compatibility module
and its drop-ins on the porting page.

The API reference is rendered by mkdocstrings from ``::: module`` lines in ``docs/api/*.md``: a class or function
appears when a page renders its module (or a package that exports it) and it has a docstring in its source (the
renderer reads the source, not ``__doc__`` set at run time). Other public names (constants, neuron definitions,
submodules) must be named on a page of ``docs/``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PUBLIC_MODULES = [
    "spikefuse",
    "spikefuse.nn",
    "spikefuse.neurons",
    "spikefuse.surrogate",
    "spikefuse.models",
    "spikefuse.data",
    "spikefuse.nir",
    "spikefuse.distributed",
    "spikefuse.train",
    "spikefuse.compat",
    "spikefuse.compat.spikingjelly",
    "spikefuse.compat.snntorch",
    "spikefuse.compat.norse",
]


@functools.lru_cache(maxsize=1)
def _rendered() -> dict[str, set | None]:
    """``{module: names}`` rendered by the API pages: None for every public member, else the ``members`` list."""
    rendered = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"::: ([\w.]+)", line)
            if m:
                follow = " ".join(lines[i + 1 : i + 3])
                members = re.search(r"members: \[([^\]]*)\]", follow)
                rendered[m.group(1)] = {n.strip() for n in members.group(1).split(",")} if members else None
    return rendered


@functools.lru_cache(maxsize=None)
def _has_source_docstring(path: str, qualname: str) -> bool:
    tree = ast.parse(Path(path).read_text())
    for node in tree.body:  # module level: a nested def of the same name is another object
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == qualname:
            return bool(ast.get_docstring(node))
    return False


@functools.lru_cache(maxsize=1)
def _docs_text() -> str:
    return "\n".join(p.read_text() for p in DOCS.rglob("*.md"))


def _named_in_docs(name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", _docs_text()) is not None


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_is_in_the_api_reference(module_name):
    module = importlib.import_module(module_name)
    rendered = _rendered()
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            owner = obj.__module__
            shown = any(
                mod in rendered and (rendered[mod] is None or name in rendered[mod]) for mod in (owner, module_name)
            )
            path = inspect.getsourcefile(inspect.unwrap(obj))  # a decorated function's own file
            if not (shown and _has_source_docstring(path, obj.__name__)):
                missing.append(f"{name} ({owner}{'' if shown else ', module not rendered'})")
        elif not _named_in_docs(name):
            missing.append(name)
    assert not missing, f"{module_name}: not in the API reference: {', '.join(missing)}"


def test_every_compat_module_is_on_the_porting_page():
    import spikefuse.compat

    porting = (DOCS / "porting.md").read_text()
    for sub in spikefuse.compat.__all__:
        if not inspect.ismodule(getattr(spikefuse.compat, sub)):  # the package's own functions, on the page too
            assert re.search(rf"`{sub}\b", porting), sub
            continue
        module = importlib.import_module(f"spikefuse.compat.{sub}")
        assert f"spikefuse.compat.{sub}" in porting, sub
        drop_ins = [n for n in module.__all__ if inspect.isclass(getattr(module, n))]
        absent = [n for n in drop_ins if not re.search(rf"`{n}\b", porting)]
        assert not absent, f"spikefuse.compat.{sub}: {', '.join(absent)} not on docs/porting.md"
