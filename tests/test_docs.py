"""Every code block of the documentation runs: the pages under ``docs/`` and the README.

One test per page runs the page's blocks in order, as a reader would:

- a ```` ```python ```` block is executed in one namespace shared by all python blocks of the page, except a
  script: ```` ```python title="NAME.py" ```` is written to ``NAME.py`` and run as ``python NAME.py`` in a
  subprocess, which must exit with 0 (for examples that start processes of their own, whose functions must be
  importable from a file);
- a ```` ```bash ```` block (``docs/`` pages only) holds ``spikefuse ...`` commands, one per line (``\\`` joins
  lines, ``#`` starts a comment); each runs in this process as ``spikefuse.cli.main(argv)`` and must return 0.
  Any other line in a bash block fails the test: shell commands that are not run here go in a ```` ```console ````
  block (README's bash block holds ``make`` targets and is not run);
- every other block (``console``, ``text``, ...) is not run.

Each page runs in a fresh working directory ``<tmp>/project``, beside ``<tmp>/shared``, a link to the repository's
``../shared`` where it exists, so that ``--out runs/...`` writes into the temporary folder and ``../shared/data/...``
means what it means from the repository root. A block right after the line ``<!-- docs-test: needs PATH -->``
needs ``PATH`` (relative to the repository root, e.g. ``../shared/data/mnist``): when it is missing, the page stops
there and its test is skipped with that reason, so such blocks come last on a page.

Keep blocks small (tiny tensors, T of a few steps, 1 epoch on a few samples): the whole file runs in about a minute
once the fused CPU kernels are compiled (numba caches them on disk after the first call).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import spikefuse
from spikefuse.cli import main as spikefuse_main

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
SRC = str(Path(spikefuse.__file__).resolve().parents[1])  # where this process imports spikefuse from: scripts too

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})(?P<lang>[\w-]*)(?P<info>.*)$")
_SCRIPT = re.compile(r'\btitle="(?P<name>[\w.-]+\.py)"')
_NEEDS = re.compile(r"^\s*<!-- docs-test: needs (?P<path>\S+) -->\s*$")


def code_blocks(text: str) -> list[tuple[str, str, int, str | None, str | None]]:
    """``(language, code, first line number, needed path or None, script name or None)`` of every fenced block,
    in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        needs = _NEEDS.match(lines[i - 1]) if i > 0 else None
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^ {{0,{indent}}}{fence}\s*$", lines[j]):
            body.append(lines[j][indent:])
            j += 1
        if j == len(lines):
            raise ValueError(f"line {i + 1}: unclosed code block")
        script = _SCRIPT.search(opening["info"])
        blocks.append(
            (
                opening["lang"],
                "\n".join(body) + "\n",
                i + 2,
                needs["path"] if needs else None,
                script["name"] if script else None,
            )
        )
        i = j + 1
    return blocks


def commands(code: str) -> list[list[str]]:
    """The commands of a bash block as argument lists: continuations joined, comments and blank lines dropped."""
    lines = code.replace("\\\n", " ").splitlines()
    return [argv for argv in (shlex.split(line, comments=True) for line in lines) if argv]


@pytest.fixture
def page_dir(tmp_path, monkeypatch):
    """``<tmp>/project`` as the working directory, ``<tmp>/shared`` linked to the repository's ``../shared``."""
    shared = REPO.parent / "shared"
    if shared.exists():
        (tmp_path / "shared").symlink_to(shared, target_is_directory=True)
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    threads = torch.get_num_threads()  # the CLI and the pages may set it
    yield project
    torch.set_num_threads(threads)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_page_code_runs(page, page_dir, monkeypatch):
    in_docs = page.parent != REPO
    # a module of its own, as a reader's script is (a dataclass looks its module up in sys.modules)
    module = types.ModuleType(f"docs.{page.stem}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for lang, code, line, needs, script in code_blocks(page.read_text()):
        if lang not in ("python", "bash") or (lang == "bash" and not in_docs):
            continue
        if needs is not None and not (REPO / needs).exists():
            pytest.skip(f"{page.name} line {line}: needs {needs}, which is missing")
        where = f"{page.relative_to(REPO)}:{line}"
        if lang == "python" and script:
            (page_dir / script).write_text(code)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
            done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{where}: python {script} failed:\n{done.stdout}\n{done.stderr}"
            continue
        if lang == "python":
            exec(compile(code, where, "exec"), namespace)
            continue
        for argv in commands(code):
            command = shlex.join(argv)
            assert argv[0] == "spikefuse", f"{where}: a bash block runs spikefuse commands only, got {command!r}"
            assert spikefuse_main(argv[1:]) == 0, f"{where}: {command!r} failed"


def test_code_blocks_parser():
    text = (
        "intro\n```python\nx = 1\n```\n<!-- docs-test: needs ../shared/data/mnist -->\n```bash\n"
        "spikefuse train \\\n  --epochs 1  # one\n# comment\n```\n- item\n\n    ```console\n    $ ls\n    ```\n"
        '```python title="demo.py"\nprint(1)\n```\n'
    )
    blocks = code_blocks(text)
    assert [(b[0], b[2], b[3], b[4]) for b in blocks] == [
        ("python", 3, None, None),
        ("bash", 7, "../shared/data/mnist", None),
        ("console", 14, None, None),
        ("python", 17, None, "demo.py"),
    ]
    assert commands(blocks[1][1]) == [["spikefuse", "train", "--epochs", "1"]]
    assert blocks[2][1] == "$ ls\n"
