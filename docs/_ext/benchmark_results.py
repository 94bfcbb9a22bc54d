"""MkDocs hook: the committed benchmark results (``benchmarks/results/*``) become part of the site.

The documentation links to the result files instead of copying their numbers; this adds every file of that folder
under the same path (``benchmarks/results/<name>``), so the ``.md`` results render as pages, the figures and
tables are served next to them, and MkDocs checks every link to them. Loaded by ``mkdocs.yml`` (``hooks``).
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File


def on_files(files, config):
    results = Path(config.config_file_path).parent / "benchmarks" / "results"
    for path in sorted(results.iterdir()):
        if path.is_file():
            files.append(File.generated(config, f"benchmarks/results/{path.name}", abs_src_path=str(path)))
    return files
