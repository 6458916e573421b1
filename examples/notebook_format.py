"""Writes each examples/*.py kept in percent format ("# %%" cells) as the notebook beside it,
so that the notebook and the importable script never differ: `python examples/notebook_format.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

MARKDOWN = "# %% [markdown]"
CODE = "# %%"


def cells_of(source: str) -> list[tuple[str, str]]:
    """(kind, text) for each cell of a percent-format script."""
    cells: list[tuple[str, list[str]]] = []
    for line in source.splitlines():
        if line.startswith(MARKDOWN):
            cells.append(("markdown", []))
        elif line.startswith(CODE):
            cells.append(("code", []))
        elif cells:
            cells[-1][1].append(line[2:] if cells[-1][0] == "markdown" and line.startswith("# ") else
                                ("" if cells[-1][0] == "markdown" and line == "#" else line))
    return [(kind, "\n".join(lines).strip("\n")) for kind, lines in cells]


def notebook_of(script: Path) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, text in cells_of(script.read_text()):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        notebook.cells.append(make(text))
    return notebook


def main(paths: list[str]) -> None:
    scripts = [Path(p) for p in paths] or sorted(Path(__file__).parent.glob("*.py"))
    for script in scripts:
        if MARKDOWN not in script.read_text() and CODE + "\n" not in script.read_text():
            continue
        target = script.with_suffix(".ipynb")
        notebook = notebook_of(script)
        for index, cell in enumerate(notebook.cells):
            cell.id = f"cell-{index}"  # stable ids: random ones would change at every write
        nbformat.write(notebook, target)
        print(f"wrote {target}")


if __name__ == "__main__":
    main(sys.argv[1:])
