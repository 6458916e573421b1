"""A stalled call in a real notebook kernel: the panel names the culprit and flags its row, and
the same panel, exported and opened in a real browser, is what docs/hangs.md shows."""

from __future__ import annotations

import os
import re
import shutil

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from test_panel import _Dom, chromium, _processes_with
from processes import wait_gone

STALLED_CALL = """
import fanrun

@fanrun.distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, stall_timeout=20, on_stall="abort")
def train():
    import time
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    class Batches(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            if dist.get_rank() == 1 and index == 20:
                time.sleep(60)  # a stuck read: the planted stall
            return torch.ones(4)

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for batch in tqdm(torch.utils.data.DataLoader(Batches(), batch_size=2), desc="train", mininterval=0.02):
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.05)
    return dist.get_rank()

train.distributed()
"""


@pytest.fixture(scope="module")
def stalled_notebook(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stalled")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(STALLED_CALL)])
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("FANRUN_DISPLAY", raising=False)
        with pytest.raises(CellExecutionError) as raised:
            NotebookClient(notebook, timeout=300, kernel_name="python3",
                           resources={"metadata": {"path": str(folder)}}).execute()
    return notebook, folder, raised.value


def test_a_stalled_call_in_a_notebook_names_its_culprit_in_the_panel(stalled_notebook):
    notebook, _, error = stalled_notebook
    assert error.ename == "RankStalledError", error
    outputs = notebook.cells[0].outputs
    panels = [o for o in outputs if o.output_type == "display_data" and "fanrun-panel" in o.data.get("text/html", "")]
    assert len(panels) == 1, outputs
    page = panels[0].data["text/html"]
    stall = re.search(r'<div class="fanrun-stall"[^>]*>(.*?)</div>', page)
    assert stall is not None, page
    assert "stalled:" in stall.group(1) and "rank 1" in stall.group(1) and "DataLoader" in stall.group(1), stall.group(1)
    rows = re.findall(r'<tr class="fanrun-rank" data-rank="(\d)".*?</tr>', page, re.S)
    assert rows == ["0", "1"], page
    culprit_row = re.search(r'<tr class="fanrun-rank" data-rank="1".*?</tr>', page, re.S).group(0)
    assert "stalled" in culprit_row and "step " in culprit_row, culprit_row


def test_the_stalled_panel_in_a_browser_is_the_screenshot_of_docs_hangs(stalled_notebook):
    from nbconvert import HTMLExporter

    notebook, folder, _ = stalled_notebook
    page = folder / "stalled.html"
    page.write_text(HTMLExporter().from_notebook_node(notebook)[0])
    profile = folder / "chromium-profile"
    dom = _Dom()
    dom.feed(chromium(profile, "--dump-dom", page.as_uri()).stdout)
    assert len(dom.with_class("fanrun-stall")) == 1
    shot = folder / "stalled.png"
    chromium(profile, "--window-size=1100,700", f"--screenshot={shot}", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("FANRUN_STALL_SCREENSHOT"):  # where docs/hangs.md's screenshot is refreshed from
        shutil.copyfile(shot, os.environ["FANRUN_STALL_SCREENSHOT"])
    assert wait_gone(_processes_with(str(profile)), timeout=10) == []
