"""``examples/notebook.ipynb`` runs end to end in a real Jupyter kernel (nbclient), as a user would run it."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A kernelspec for this very interpreter, found through JUPYTER_PATH (nothing installed for the user)."""
    spec = tmp_path / "jupyter" / "kernels" / "dask-ddp-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dask-ddp test", "language": "python",
        # the kernel runs in tmp_path: it imports this checkout's dask_ddp, not whichever is installed
        "env": {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "dask-ddp-test"


def _text(output) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    data = output.get("data", {})
    return data.get("text/plain", "") + data.get("text/html", "")


def _execute(nb, kernel_name: str, tmp_path) -> None:
    """Run every cell of ``nb`` in a real kernel, in ``tmp_path``, as Jupyter would (outputs land in ``nb``)."""
    nbclient.NotebookClient(nb, kernel_name=kernel_name, timeout=240,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()


@pytest.mark.slow
def test_notebook_runs_end_to_end(kernel_name, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    _execute(nb, kernel_name, tmp_path)

    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    text = "\n".join(_text(o) for c in code for o in c.outputs)
    assert "Traceback" not in text, text

    final = re.search(r"final loss: (\d+\.\d+)", text)
    assert final, text
    assert float(final.group(1)) < 0.01, "the model did not learn y = x @ w"
    assert "[rank 0] step 0: loss" in text  # the rank's print, echoed in the notebook

    # the bar and the per-rank table under it are widgets (ipywidgets comes with the package): no text bar
    run_cell = next(c for c in code if "job.result()" in c.source)
    views = [o for o in run_cell.outputs if WIDGET_VIEW in o.get("data", {})]
    assert len(views) >= 2, run_cell.outputs  # tqdm's bar, the live table
    # no cell prints a warning (TqdmWarning: IProgress not found, a FutureWarning, ...)
    warned = [t for c in code for o in c.outputs for t in [_text(o)] if "Warning" in t or "warn(" in t]
    assert not warned, warned
    table = _text(next(c for c in code if c.source.strip() == "job").outputs[0])
    assert "FINISHED" in table and table.count("<tr") == 3 and " ms</td>" in table  # both ranks, step times

    tail = next(c for c in code if "job.metrics.tail()" in c.source)
    assert "loss" in _text(tail.outputs[0]) and "rank" in _text(tail.outputs[0])
    assert re.search(r"20\d\d-\d\d-\d\d \d\d:\d\d:\d\d", _text(tail.outputs[0])), "time is not a timestamp"
    assert "e+09" not in _text(tail.outputs[0]) and "elapsed" in _text(tail.outputs[0])
    plot = next(c for c in code if "job.plot(" in c.source)
    assert any("image/png" in o.get("data", {}) for o in plot.outputs), "job.plot() drew no figure"


@pytest.mark.slow
def test_functions_defined_in_cells_work_on_the_ranks_as_in_the_notebook(kernel_name, tmp_path):
    """A cell's functions ship by value. cloudpickle 3.1.3 names them "<dynamic-code>": the traceback the notebook
    got for a failing rank named no file and showed no line of the cell. And a rank that hands one of them to a
    multiprocessing Pool (as the notebook itself can) failed: "Can't pickle <function square>: attribute lookup
    square on __main__ failed", since the rank's __main__ is not the notebook's."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "import traceback\nimport dask_ddp\nfrom dask.distributed import Client, LocalCluster\n"
        "cluster = LocalCluster(n_workers=2, threads_per_worker=1, host='127.0.0.1', dashboard_address=None)\n"
        "client = Client(cluster)",
        "def train():\n    rank = dask_ddp.get_context().rank\n"
        "    raise ValueError(f'diverged on rank {rank}')  # the line the user must see",
        "try:\n    dask_ddp.dispatch.run(client, train, progress=False).result(timeout=120)\n"
        "except ValueError:\n    print(traceback.format_exc())",
        "import multiprocessing\n\nclass Scale:\n    def __init__(self, k):\n        self.k = k\n\n"
        "def square(x):\n    return x * x\n\n"
        "def preprocess():\n    with multiprocessing.get_context('fork').Pool(2) as pool:\n"
        "        return pool.map(square, range(4)), pool.map(Scale, [2])[0].k\n\n"
        "print('pool', dask_ddp.dispatch.run(client, preprocess, progress=False).result(timeout=120))",
        "client.close(); cluster.close()",
    )]
    _execute(nb, kernel_name, tmp_path)
    text = "".join(_text(o) for o in nb.cells[2].outputs)
    assert "raise ValueError(f'diverged on rank {rank}')  # the line the user must see" in text, text
    assert re.search(r'File "[^"]*ipykernel[^"]*", line 3, in train', text), text
    assert "<dynamic-code>" not in text
    pool = "".join(_text(o) for o in nb.cells[3].outputs)
    assert "pool [([0, 1, 4, 9], 2), ([0, 1, 4, 9], 2)]" in pool, nb.cells[3].outputs
