"""Pages the documentation build writes before Sphinx reads the sources (into ``docs/generated/``, not in git).

- ``settings.md``: every key of ``dask_ddp/ddp.yaml`` with its default and the comment beside it, so the
  settings reference is the file itself and never drifts from it;
- ``guide-toctree.md``: the user guide's table of contents (with ``hpc.md`` when it exists);
- ``cli.md``: the ``--help`` of ``dask-ddp`` and of each of its commands, as the installed command prints them;
- ``notebook.ipynb``: ``examples/notebook.ipynb`` (executed by MyST-NB during the build);
- ``trainers-<library>.ipynb``: ``examples/trainers/<library>.ipynb``, Lightning's, Transformers' and Accelerate's
  (executed too);
- the figures kept outside ``docs/`` (``benchmarks/scale.png``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

COMMANDS = ([], ["run"], ["demo"])
# The user guide's pages, in the order of the site's navigation. hpc.md (HPC clusters, SLURM) sits in docs/ itself
# and is listed when it is there.
GUIDE = ("guide/launching", "guide/metrics", "guide/s3-data", "guide/streaming", "guide/checkpoints", "guide/sharded",
         "guide/preemption", "guide/many-hosts", "guide/kubernetes", "hpc", "guide/sweeps", "guide/trainers", "guide/cli", "guide/reliability", "guide/from-torchrun",
         "guide/from-dask-pytorch-ddp")  # from docs/; guide/index.md includes the list
FIGURES = ("benchmarks/scale.png",)
TRAINER_NOTEBOOKS = ("lightning", "transformers", "accelerate")  # examples/trainers/<name>.ipynb, executed too


def all_pages(root: Path, out: Path) -> None:
    """Write every generated page and file under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "settings.md", settings_page(root / "dask_ddp" / "ddp.yaml"))
    _write(out / "cli.md", cli_page())
    _write(out / "guide-toctree.md", guide_toctree(root / "docs"))
    _copy(root / "examples" / "notebook.ipynb", out / "notebook.ipynb")
    for name in TRAINER_NOTEBOOKS:
        _copy(root / "examples" / "trainers" / f"{name}.ipynb", out / f"trainers-{name}.ipynb")
    for figure in FIGURES:
        _copy(root / figure, out / Path(figure).name)


def _write(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:  # untouched files keep Sphinx's incremental build
        path.write_text(text)


def _copy(src: Path, dst: Path) -> None:
    if not dst.exists() or dst.read_bytes() != src.read_bytes():
        shutil.copyfile(src, dst)


def guide_toctree(docs: Path) -> str:
    """The user guide's table of contents (guide/index.md includes it): every page of GUIDE that exists, as
    absolute document names."""
    pages = [f"/{p}" for p in GUIDE if (docs / f"{p}.md").exists()]
    return "```{toctree}\n:maxdepth: 1\n\n" + "\n".join(pages) + "\n```\n"


def settings(path: Path) -> list[tuple[str, object, str]]:
    """``(dotted key, default, description)`` for every leaf of the YAML file, in file order. The description is
    the comment on the key's line and the comment-only lines under it (indented past the key)."""
    defaults = yaml.safe_load(path.read_text())
    rows: list[tuple[str, object, str]] = []
    stack: list[tuple[int, str]] = []
    for line in path.read_text().splitlines():
        m = re.match(r"^(\s*)([\w-]+):(.*)$", line)
        if not m:
            comment = line.strip()
            if comment.startswith("#") and rows and line.startswith(" "):  # a key's comment goes on
                key, default, text = rows[-1]
                rows[-1] = (key, default, f"{text} {comment.lstrip('#').strip()}".strip())
            continue
        indent, name, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, name))
        value, _, comment = rest.partition(" #")
        if value.strip():  # a leaf
            dotted = ".".join(n for _, n in stack)
            node: object = defaults
            for part in dotted.split("."):
                node = node[part]  # type: ignore[index]
            rows.append((dotted, node, comment.strip().lstrip("#").strip()))
    return rows


def _default(value: object) -> str:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"`{text}`"


def settings_page(path: Path) -> str:
    """The settings reference as a Markdown table (key, default, what it does)."""
    lines = ["| setting | default | what it does |", "|---|---|---|"]
    for key, default, text in settings(path):
        lines.append(f"| `{key}` | {_default(default)} | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def cli_page() -> str:
    """The ``--help`` text of ``dask-ddp`` and each command, in code blocks under a heading each."""
    parts = []
    env = {**os.environ, "COLUMNS": "100"}
    for command in COMMANDS:
        out = subprocess.run([sys.executable, "-m", "dask_ddp.cli", *command, "--help"], capture_output=True,
                             text=True, timeout=120, env=env, check=True).stdout
        name = " ".join(["dask-ddp", *command])
        parts.append(f"## `{name}`\n\n```text\n{out.rstrip()}\n```\n")
    return "\n".join(parts)
