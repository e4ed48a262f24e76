"""The documentation site (docs/) builds with warnings as errors, and what it links and names resolves.

One Sphinx build for the module (``-W --keep-going``, nitpicky: every reference to a ``dask_ddp`` name must
resolve; the example notebook runs in a real kernel during it). Then, on the built site: every public name has
its entry in the API reference; every link between pages, and every ``#anchor``, points at a page and an
element that exist; every ``dask_ddp.*`` name written in the pages imports; the notebook page shows the outputs
of its run; the settings page lists every setting of ``ddp.yaml``; the first commands are the README's.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from test_wings import PUBLIC

import dask_ddp

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
pytest.importorskip("sphinx", reason="the docs extra is in the test extra: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site (HTML), from a build with warnings as errors."""
    out = tmp_path_factory.mktemp("docs")
    started = time.monotonic()
    build = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
                            "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    warnings = [ln for ln in build.stderr.splitlines() if "WARNING" in ln or "ERROR" in ln]
    assert build.returncode == 0, "the docs build failed (warnings are errors):\n" + "\n".join(
        warnings or build.stderr.splitlines()[-40:])
    print(f"docs build: {time.monotonic() - started:.1f} s")
    return out / "html"


def _inventory(site: Path) -> dict[str, str]:
    from sphinx.util.inventory import InventoryFile

    with open(site / "objects.inv", "rb") as f:
        inv = InventoryFile.load(f, "", lambda base, uri: uri)
    data = getattr(inv, "data", inv)  # Sphinx 9: a _Inventory; before: a dict
    return {name: kind for kind, entries in data.items() if kind.startswith("py:") for name in entries}


def _resolve(dotted: str) -> object:
    """The object a dotted name stands for (a module, or an attribute of the longest importable module)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def public_names() -> list[str]:
    names = [f"dask_ddp.{n}" for n in dask_ddp.__all__]
    for module, listed in PUBLIC.items():
        mod = importlib.import_module(module)
        names += [f"{module}.{n}" for n in dict.fromkeys(listed + list(getattr(mod, "__all__", [])))]
    return list(dict.fromkeys(names))


@pytest.mark.slow
def test_every_public_name_has_an_entry_in_the_api_reference(site):
    inventory = _inventory(site)
    documented: dict[int, str] = {}
    for name in inventory:
        try:
            documented.setdefault(id(_resolve(name)), name)
        except (ImportError, AttributeError):
            pytest.fail(f"the site documents {name}, which does not import")
    missing = [n for n in public_names() if n not in inventory and id(_resolve(n)) not in documented]
    assert not missing, f"public names the API reference does not document: {missing} (add them to " \
                        "docs/reference/api.md)"
    for module in ("dask_ddp", "dask_ddp.dispatch", "dask_ddp.checkpoint", "dask_ddp.data", "dask_ddp.compat",
                   "dask_ddp.cli", "dask_ddp.dashboard"):
        assert inventory.get(module) == "py:module", module


class _Page(HTMLParser):
    """The links (href) and the element ids of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])


def _pages(site: Path) -> dict[Path, _Page]:
    pages = {}
    for path in site.rglob("*.html"):
        if "_modules" in path.parts or "_static" in path.parts:
            continue
        page = _Page()
        page.feed(path.read_text())
        pages[path] = page
    return pages


@pytest.mark.slow
def test_every_internal_link_and_anchor_resolves(site):
    pages = _pages(site)
    assert len(pages) >= 25, sorted(p.name for p in pages)
    broken = []
    for path, page in pages.items():
        for href in page.links:
            url = urlsplit(href)
            if url.scheme or url.netloc or href.startswith("mailto:"):
                continue
            target = (path.parent / unquote(url.path)).resolve() if url.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site)}: {href} (no such file)")
            elif url.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else set()
                if unquote(url.fragment) not in ids:
                    broken.append(f"{path.relative_to(site)}: {href} (no element #{url.fragment})")
    assert not broken, "broken links in the site:\n" + "\n".join(sorted(set(broken)))


def test_every_dask_ddp_name_in_the_pages_imports():
    sources = [p for p in DOCS.rglob("*.md") if "generated" not in p.parts and "_build" not in p.parts]
    names = {n for p in sources for n in re.findall(r"\bdask_ddp(?:\.[A-Za-z_]\w*)+", p.read_text())}
    assert len(names) > 20, names
    broken = []
    for dotted in sorted(names):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError):
            broken.append(dotted)
    assert not broken, f"the pages name dask_ddp names that do not import: {broken}"


@pytest.mark.slow
def test_the_notebook_page_shows_the_outputs_of_its_run(site):
    html = (site / "generated" / "notebook.html").read_text()
    loss = re.search(r"final loss: (\d+\.\d+)", html)
    assert loss and float(loss.group(1)) < 0.01, "the notebook's run did not print a small final loss"
    assert "<table" in html and "elapsed" in html, "job.metrics.tail() shows no table"
    assert re.search(r'<img[^>]+src="[^"]+\.png"', html), "job.plot() shows no figure"
    assert "Traceback" not in html


def test_the_settings_page_lists_every_setting_with_its_default():
    import dask

    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import generate
    finally:
        sys.path.remove(str(DOCS / "_ext"))

    def leaves(node, prefix="ddp"):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from leaves(value, f"{prefix}.{key}")
            else:
                yield f"{prefix}.{key}", value

    rows = generate.settings(ROOT / "dask_ddp" / "ddp.yaml")
    import yaml

    expected = dict(leaves(yaml.safe_load((ROOT / "dask_ddp" / "ddp.yaml").read_text())["ddp"]))
    assert [(k, v) for k, v, _ in rows] == list(expected.items())
    assert all(text for _, _, text in rows), [k for k, _, text in rows if not text]
    assert dask.config.get("ddp.stall-timeout") is expected["ddp.stall-timeout"]
    page = generate.settings_page(ROOT / "dask_ddp" / "ddp.yaml")
    assert "| `ddp.events.flush-interval` | `1.0` |" in page and "| `ddp.zygote` | `true` |" in page


@pytest.mark.slow
def test_the_settings_and_cli_pages_are_in_the_site(site):
    settings = (site / "reference" / "settings.html").read_text()
    assert "ddp.preemption.grace-period" in settings and "ddp.telemetry.straggler-window" in settings
    cli = (site / "guide" / "cli.html").read_text()
    assert "--ship-limit" in cli and "usage: dask-ddp demo" in cli


def test_the_getting_started_commands_are_the_readmes():
    def first_bash(text: str) -> str:
        return re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)

    readme = (ROOT / "README.md").read_text()
    assert first_bash((DOCS / "getting-started.md").read_text()) == first_bash(readme)


def test_the_readmes_links_point_at_files_of_the_repository():
    readme = (ROOT / "README.md").read_text()
    links = [m for m in re.findall(r"\]\(([^)\s]+)\)", readme) if not urlsplit(m).scheme]
    assert any(link.startswith("docs/") for link in links), "the README links the documentation"
    missing = [link for link in links if not (ROOT / urlsplit(link).path).exists()]
    assert not missing, f"README links files that do not exist: {missing}"
