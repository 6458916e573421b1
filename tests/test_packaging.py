"""fanrun as users get it: the wheel `make wheel` builds, installed alone into a clean virtual
environment, and the README's quickstart run exactly as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def test_the_test_group_installs_every_extra():
    """`make setup` installs the test group, never the extras: a package added to an extra but
    not to the group would go untested."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    group = {Requirement(r).name: Requirement(r) for r in project["dependency-groups"]["test"]}
    for extra, requirements in project["project"]["optional-dependencies"].items():
        for text in requirements:
            required = Requirement(text)
            assert required.name in group, f"fanrun[{extra}] needs {text}, which the test group lacks"
            assert group[required.name].specifier == required.specifier, (
                f"fanrun[{extra}] asks for {text}, the test group for {group[required.name]}"
            )


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a first build also compiles zig's libc++ for glibc 2.28, once per machine
def test_wheel_alone_in_a_clean_venv_runs_a_two_rank_call(tmp_path):
    """The wheel, built as `make wheel` builds it, is a manylinux one by auditwheel's own check,
    and works in a venv of its own with only its declared dependencies: no torch, no MLflow,
    neither build/ nor src/ anywhere on the path, and the libcurl it loads is the one inside it.
    Each rank runs under the wheel's own fanrun-keeper."""
    wheels = tmp_path / "wheels"
    # With this test's Python alone (ABI3_PYTHON empty): on 3.11 the cp311 wheel, on 3.12 and
    # later the abi3 one.
    built = subprocess.run(["make", "-C", str(ROOT), "wheel", f"WHEEL_DIR={wheels}", f"PYTHON={sys.executable}",
                            "ABI3_PYTHON="], capture_output=True, text=True, timeout=1500)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("fanrun-*.whl")
    python_tag = "cp312-abi3" if sys.version_info >= (3, 12) else "cp311-cp311"
    assert re.fullmatch(rf"fanrun-[^-]+-{python_tag}-manylinux_2_28_x86_64\.whl", wheel.name), wheel.name

    auditwheel = ROOT / "build" / "manylinux" / "tools" / "bin" / "auditwheel"
    shown = subprocess.run([str(auditwheel), "show", str(wheel)], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert 'is consistent with the following platform tag: "manylinux_2_28_x86_64"' in " ".join(shown.stdout.split()), \
        shown.stdout

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    installed = subprocess.run([python, "-m", "pip", "install", "--quiet", str(wheel)],
                               capture_output=True, text=True, env=clean_env, timeout=600)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    program = tmp_path / "two_ranks.py"
    program.write_text(
        "import importlib.util, os, sys\n"
        "import fanrun, fanrun._core\n"
        "from fanrun import distributed\n"
        "print('module', fanrun.__file__)\n"
        "print('path', sys.path)\n"
        "print('torch', importlib.util.find_spec('torch') is not None)\n"
        "mapped = {line.split()[-1] for line in open('/proc/self/maps') if 'libcurl' in line}\n"
        "print('libcurl', sorted(mapped))\n"
        "@distributed(num_accelerators=2, tracking=False)\n"
        "def rank():\n"
        "    keeper = os.readlink(f'/proc/{os.getppid()}/exe')\n"
        "    return int(os.environ['RANK']) * 10 + int(os.environ['WORLD_SIZE']), keeper\n"
        "results = rank.distributed()\n"
        "print('result', [value for value, _ in results])\n"
        "print('keepers', sorted({keeper for _, keeper in results}))\n"
    )
    done = subprocess.run([python, "-I", str(program)], capture_output=True, text=True,
                          cwd=tmp_path, env=clean_env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["module"].startswith(str(env_dir)), lines["module"]
    package = Path(lines["module"]).parent
    assert str(ROOT) not in lines["path"]
    assert lines["torch"] == "False"
    (libcurl,) = eval(lines["libcurl"], {})
    assert Path(libcurl).parent == package.parent / "fanrun.libs", libcurl
    assert lines["result"] == "[2, 12]"
    assert eval(lines["keepers"], {}) == [str(package / "fanrun-keeper")]


def test_readme_quickstart_runs_as_written_on_the_cpu(tmp_path):
    readme = (ROOT / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart"):]
    code = re.search(r"```python\n(.*?)```", quickstart, re.S).group(1)
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    # As a user runs it: tracking on, its store wherever fanrun puts it from this directory.
    env = {k: v for k, v in os.environ.items() if k != "FANRUN_TRACKING"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # The printed list of floats; the call's MLflow line may come before or after it.
    (printed,) = [line for line in done.stdout.splitlines() if line.startswith("[")]
    losses = eval(printed, {})
    assert len(losses) == 2 and all(isinstance(loss, float) for loss in losses)
    assert max(losses) < 1.0, f"the quickstart's model did not learn: {losses}"
