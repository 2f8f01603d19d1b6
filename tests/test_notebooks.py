"""Every notebook in ``notebooks/`` runs top to bottom and is saved without outputs.

Each notebook runs in a fresh ``python3`` kernel of this interpreter (ipykernel), with this
checkout first on ``PYTHONPATH``, ``MPLBACKEND=Agg``, one torch thread unless
``OMP_NUM_THREADS`` says otherwise, and a temporary working directory, so what a notebook
writes never lands in the repository. New notebooks are picked up by the glob. Needs the
``dev`` extra (nbclient, nbformat, ipykernel).
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the dev extra")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the dev extra")
ipykernel_kernelspec = pytest.importorskip(
    "ipykernel.kernelspec", reason="notebook tests need the dev extra"
)

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # generous: the notebooks aim for < 60 s in all on 2 shared CPU cores
KERNEL_STARTUP_TIMEOUT_S = 120

STRIP_HINT = (
    "strip them before committing: in JupyterLab, Edit > Clear Outputs of All Cells, then "
    "save; or `jupyter nbconvert --clear-output --inplace {path}`; or, with only the dev "
    'extra: python -c "import nbformat, sys; p = sys.argv[1]; nb = nbformat.read(p, 4); '
    "[c.update(outputs=[], execution_count=None) for c in nb.cells if c.cell_type == "
    "'code']; nbformat.write(nb, p)\" {path}"
)
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _notebook_id(path: pathlib.Path) -> str:
    return path.name


@pytest.fixture(scope="module")
def python3_kernel(tmp_path_factory):
    """A ``python3`` kernelspec for this very interpreter, first on the Jupyter path.

    A ``python3`` spec installed elsewhere (a user's, another environment's) could start a
    different Python; this one runs ``sys.executable -m ipykernel_launcher``.
    """
    jupyter_dir = tmp_path_factory.mktemp("jupyter")
    python_path = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    ipykernel_kernelspec.write_kernel_spec(
        jupyter_dir / "kernels" / "python3",
        overrides={
            "display_name": "Python 3 (llmlab notebook tests)",
            "env": {
                "MPLBACKEND": "Agg",
                "PYTHONPATH": python_path,
                # One torch thread: on a small CPU shared with other processes, two
                # intra-op threads spin against each other and steps get ~10x slower.
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            },
        },
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(jupyter_dir))
        yield "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_notebook_id)
def test_notebook_is_saved_without_outputs(path: pathlib.Path):
    notebook = nbformat.read(path, as_version=4)
    dirty = [
        i
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    if dirty:
        relative = path.relative_to(REPO_ROOT)
        pytest.fail(
            f"{relative} is saved with outputs or execution counts in cell(s) {dirty}; "
            + STRIP_HINT.format(path=relative),
            pytrace=False,
        )


@pytest.mark.slow  # a fresh Jupyter kernel per notebook: 15-65 s each on 2 cores
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_notebook_id)
def test_notebook_runs_top_to_bottom(path: pathlib.Path, python3_kernel: str, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        kernel_name=python3_kernel,
        timeout=CELL_TIMEOUT_S,
        startup_timeout=KERNEL_STARTUP_TIMEOUT_S,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        message = _ANSI_ESCAPE.sub("", str(error))
        pytest.fail(f"{path.name}: a cell raised\n{message}", pytrace=False)
    except nbclient.exceptions.CellTimeoutError as error:
        pytest.fail(f"{path.name}: a cell ran past {CELL_TIMEOUT_S} s\n{error}", pytrace=False)
    # Run where a user opens it (notebooks/), a notebook must leave `git status` clean:
    # recordings and figures go to a scratch folder, never the working directory.
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not left, f"{path.name} wrote {left} into its working directory"
