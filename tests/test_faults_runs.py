"""The fault matrix of the runs directory: what fanrun prunes, whose directories it accepts,
how a rank reads its payload, and the modes of everything it writes there."""

from __future__ import annotations

import os
import pickle
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import fanrun
from fanrun import distributed
from fanrun._spec import paths as _paths
from fanrun._rank.worker import bootstrap_code
from processes import processes_of_runs_under

NOBODY = 65534


@distributed(num_accelerators=1)
def where_am_i():
    import os

    return os.environ["FANRUN_RUN_DIR"]


@distributed(num_accelerators=1)
def report_modes():
    import os
    import stat

    run_dir = os.environ["FANRUN_RUN_DIR"]
    return {name: stat.S_IMODE(os.stat(os.path.join(run_dir, name)).st_mode) for name in os.listdir(run_dir)}


@distributed(num_accelerators=1)
def fails():
    raise ValueError("written to the error file")


class WritesMarker:
    """Unpickling this runs open(marker, "w"): proof that a planted payload was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def planted_payload(marker: Path) -> bytes:
    return pickle.dumps(WritesMarker(marker)) + pickle.dumps(WritesMarker(marker))


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def runs_root(runs_dir, monkeypatch, request):
    """A fresh FANRUN_RUNS_DIR of this test's own, under the session's (so that the
    no_process_left_behind fixture sees its ranks)."""
    root = runs_dir / f"faults-{request.node.name[:60]}"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("FANRUN_RUNS_DIR", str(root))
    return root


@pytest.fixture
def public_tmp():
    """A folder under /tmp that uid 65534 can reach (pytest's tmp_path is private to root).
    Proves afterwards that no rank of a run under it is left."""
    base = Path(tempfile.mkdtemp(prefix="fanrun-faults-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
        assert not processes_of_runs_under(str(base))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_nobody(action) -> None:
    """Runs action() in a forked child as uid/gid 65534: what a hostile local user can do."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


class RunSwapper:
    """A hostile user who can write `root`: each run directory that appears there is renamed
    away after a delay and replaced by one of theirs, whose payload.pkl is planted (and
    planted again after the caller writes its own). The delays differ from run to run, so
    that one of them falls between the caller writing its payload and a rank reading it:
    against a caller that accepts such a root, a rank unpickles the plant."""

    DELAYS_S = (0.0, 0.005, 0.01, 0.02, 0.04, 0.08)

    def __init__(self, root: Path, marker: Path) -> None:
        self.stop = root.parent / f"{root.name}.stop-swapping"
        evil = planted_payload(marker)
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                self._swap(root, evil)
            finally:
                os._exit(0)

    def _swap(self, root: Path, evil: bytes) -> None:
        seen: set[str] = set()
        taken: list[Path] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not os.path.exists(self.stop):
            try:
                names = set(os.listdir(root))
            except OSError:
                names = set()
            for name in sorted(names - seen):
                seen.update((name, f"{name}.taken"))
                time.sleep(self.DELAYS_S[len(taken) % len(self.DELAYS_S)])
                try:
                    os.rename(root / name, root / f"{name}.taken")
                    os.mkdir(root / name, 0o777)
                    taken.append(root / name)
                except OSError:
                    pass
            for directory in taken:
                payload = directory / "payload.pkl"
                try:
                    if os.lstat(payload).st_uid == NOBODY:
                        continue
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                try:
                    (directory / ".plant").write_bytes(evil)
                    os.replace(directory / ".plant", payload)
                except OSError:
                    pass
            time.sleep(0.0005)  # the attacker's poll, fast against a rank's start-up

    def close(self) -> None:
        Path(self.stop).touch()
        os.waitpid(self.pid, 0)


def read_line_with(process: subprocess.Popen, needle: str, timeout: float = 60) -> str:
    """The first line of process's stdout that holds needle; fails after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, remaining))
        if not ready:
            raise AssertionError(f"no line with {needle!r} within {timeout} s")
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"the process ended before a line with {needle!r}: rc={process.wait()}")
        if needle in line:
            return line


# --- Item: pruning deletes only what fanrun made -------------------------------------


def test_foreign_directories_and_files_in_the_runs_dir_survive_every_call(runs_root, monkeypatch):
    """A runs directory shared with other things (a git checkout, a thesis, datasets, dated
    folders, files) loses none of them, however many calls prune it; each call's own
    directory is never pruned by itself."""
    foreign = [".git", "1999_thesis", "2025-11-29", *(f"dataset_{i:02d}" for i in range(100))]
    for name in foreign:
        (runs_root / name).mkdir()
        (runs_root / name / "content.txt").write_text(name)
    (runs_root / "notes.txt").write_text("mine")
    # Old-style names, as fanrun's own once were, but without fanrun's marker.
    (runs_root / "20240101-000000-train-abcdef").mkdir()
    (runs_root / "20240101-000000-000000-train-abcdef").mkdir()

    own = [where_am_i.distributed()[0] for _ in range(3)]
    monkeypatch.setattr(_paths, "KEEP_RUNS", 1)
    own += [where_am_i.distributed()[0] for _ in range(2)]

    for name in foreign:
        assert (runs_root / name / "content.txt").read_text() == name
    assert (runs_root / "notes.txt").read_text() == "mine"
    assert (runs_root / "20240101-000000-train-abcdef").is_dir()
    assert (runs_root / "20240101-000000-000000-train-abcdef").is_dir()
    assert Path(own[-1], "rank_0.log").exists()  # the last call's own run is kept
    assert [Path(d).exists() for d in own] == [False, False, False, False, True]


def test_runs_beyond_the_limit_are_pruned_oldest_first(runs_root, monkeypatch):
    """Past the newest KEEP_RUNS runs, each new call removes the oldest finished runs."""
    monkeypatch.setattr(_paths, "KEEP_RUNS", 3)
    made = []
    for call in range(6):
        made.append(where_am_i.distributed()[0])
        present = [Path(d).exists() for d in made]
        assert present == [index > call - 3 for index in range(call + 1)], present


def test_more_than_a_hundred_runs_are_pruned_to_the_newest_hundred(runs_root):
    """With the real limit: 105 finished runs and one call leave the newest 100."""
    fillers = []
    for _ in range(105):
        paths = _paths.RunPaths.create("filler")
        paths.close()
        fillers.append(paths.directory.name)
    newest = where_am_i.distributed()[0]
    left = sorted(p.name for p in runs_root.iterdir() if p.name != "records")  # the runs' records, beside them
    assert len(left) == _paths.KEEP_RUNS == 100
    assert left == sorted(fillers[6:] + [Path(newest).name])


def test_two_processes_pruning_at_once_each_keep_their_own_runs(runs_root, monkeypatch):
    """Two callers creating and pruning runs in the same directory at the same time: no
    error in either, no run pruned while its owner holds it, nothing foreign removed."""
    (runs_root / "keep_me").mkdir()
    script = textwrap.dedent(
        """
        import sys
        from fanrun._spec import paths as _paths
        _paths.KEEP_RUNS = 2
        for i in range(40):
            paths = _paths.RunPaths.create(sys.argv[1])
            assert paths.directory.is_dir(), paths.directory  # not pruned by the other process
            (paths.directory / "mine").write_text("x")
            paths.close()
        print("ok")
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, who], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for who in ("a", "b")]
    outcomes = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outcomes
    assert (runs_root / "keep_me").is_dir()

    def runs() -> list[str]:
        return sorted(p.name for p in runs_root.iterdir() if p.name != "keep_me")

    # The last pruning spared the run the other caller held then, whatever its age: one more.
    assert len(runs()) <= 2 + 1, runs()
    # The next call prunes it: the newest two are left.
    monkeypatch.setattr(_paths, "KEEP_RUNS", 2)
    before = runs()
    _paths.RunPaths.create("c").close()
    assert len(runs()) == 2 and runs()[0] == before[-1], (before, runs())


# --- Item: a running call's directory is never pruned ---------------------------------


def test_a_live_call_survives_many_short_calls_from_another_process(runs_root, monkeypatch, tmp_path):
    """A long call (a decorated function, and `fanrun run` from the command line) keeps its
    directory, result and logs while another process makes many short calls that prune;
    the run of a caller killed with SIGKILL is no longer protected and goes."""
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    release_function, release_cli = tmp_path / "release-function", tmp_path / "release-cli"
    os.mkfifo(release_function)
    os.mkfifo(release_cli)
    crashed = subprocess.Popen(
        [sys.executable, "-m", "fanrun", "run", "-n", "1", "--no-python", "/bin/sh", "-c", 'echo started "$FANRUN_RUN_DIR"; exec sleep 300'],
        stdout=subprocess.PIPE, text=True,
    )
    crashed_dir = read_line_with(crashed, "started").split()[-1]
    function_caller = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import sys
            from fanrun import distributed

            @distributed(num_accelerators=1)
            def long_call(release):
                import os
                print("started", os.environ["FANRUN_RUN_DIR"], flush=True)
                with open(release) as f:
                    f.read()
                return "long call done"

            print("result:", long_call.distributed(sys.argv[1])[0])
            """
        ), str(release_function)],
        stdout=subprocess.PIPE, text=True,
    )
    cli_caller = subprocess.Popen(
        [sys.executable, "-m", "fanrun", "run", "-n", "1", "--no-python", "/bin/sh", "-c", 'echo started "$FANRUN_RUN_DIR"; read x < "$0"; echo cli done', str(release_cli)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        function_dir = read_line_with(function_caller, "started").split()[-1]
        cli_dir = read_line_with(cli_caller, "started").split()[-1]
        crashed.send_signal(signal.SIGKILL)
        crashed.wait(timeout=30)

        monkeypatch.setattr(_paths, "KEEP_RUNS", 2)
        for _ in range(6):
            where_am_i.distributed()

        assert Path(function_dir).is_dir() and Path(cli_dir).is_dir()
        assert not Path(crashed_dir).exists()  # its owner is dead: pruned
        for release in (release_function, release_cli):
            with open(release, "w") as f:  # waits for the rank to open it
                f.write("go\n")
        out, _ = function_caller.communicate(timeout=60)
        assert function_caller.returncode == 0 and "result: long call done" in out
        out, _ = cli_caller.communicate(timeout=60)
        assert cli_caller.returncode == 0 and "cli done" in out
        assert "started" in Path(function_dir, "rank_0.log").read_text()
        assert "cli done" in Path(cli_dir, "rank_0.log").read_text()
    finally:
        for process in (crashed, function_caller, cli_caller):
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdout.close()


# --- Item: only the caller's own, private runs directory is used ----------------------


@pytest.mark.parametrize("hostile", ["owned by uid 65534", "mode 0777"])
def test_a_runs_root_others_can_write_is_refused_before_anything_starts(hostile, public_tmp, monkeypatch):
    """FANRUN_RUNS_DIR owned by another user, or writable by others, is refused with an
    error that says what is wrong and what to do; no run directory is made there, no rank
    starts, and a payload planted by that user is never unpickled."""
    root = public_tmp / "runs"
    root.mkdir()
    if hostile == "mode 0777":
        root.chmod(0o777)
    else:
        os.chown(root, NOBODY, NOBODY)
    marker = public_tmp / "unpickled"
    monkeypatch.setenv("FANRUN_RUNS_DIR", str(root))
    swapper = RunSwapper(root, marker)
    outcomes: list[object] = []
    try:
        for _ in RunSwapper.DELAYS_S:
            try:
                outcomes.append(where_am_i.distributed())
            except Exception as error:
                outcomes.append(error)
    finally:
        swapper.close()
    assert not marker.exists(), "a rank unpickled the payload another user planted"
    assert all(isinstance(o, fanrun.UnsafePathError) for o in outcomes), outcomes
    assert isinstance(outcomes[0], PermissionError) and isinstance(outcomes[0], fanrun.FanrunError)
    message = str(outcomes[0])
    assert str(root) in message and "FANRUN_RUNS_DIR" in message
    assert ("uid 65534" in message) if hostile != "mode 0777" else ("0777" in message and "chmod 700" in message)
    assert os.listdir(root) == []


def test_the_default_runs_root_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    """$XDG_CACHE_HOME/fanrun/runs owned by another user is refused, not used, and not
    silently swapped for another directory."""
    monkeypatch.delenv("FANRUN_RUNS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "fanrun" / "runs"
    root.mkdir(parents=True)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match="uid 65534"):
        where_am_i.distributed()
    assert os.listdir(root) == []


FALLBACK_CALLER = textwrap.dedent(
    """
    import os, sys
    from fanrun import distributed

    @distributed(num_accelerators=1)
    def where():
        import os
        return os.environ["FANRUN_RUN_DIR"]

    for _ in range(int(sys.argv[1])):
        try:
            print("ran in", where.distributed()[0])
        except Exception as error:
            print(f"refused: {type(error).__name__}: {error}")
    """
)


def fallback_env(public_tmp: Path) -> dict[str, str]:
    """A caller whose cache directory is unusable (a file), so that runs go under $TMPDIR."""
    tmp = public_tmp / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)  # like /tmp: anyone may create, only owners may rename or remove
    (public_tmp / "not-a-directory").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "FANRUN_RUNS_DIR"}
    env.update(TMPDIR=str(tmp), XDG_CACHE_HOME=str(public_tmp / "not-a-directory"))
    return env


@pytest.mark.parametrize("plant", ["directory", "symlink"])
def test_a_planted_tmpdir_fallback_is_refused(plant, public_tmp):
    """When the cache directory is unusable, runs go to $TMPDIR/fanrun-<uid>/runs; if another
    user made $TMPDIR/fanrun-<uid> first (a directory of theirs, or a link to a directory
    of the caller's), the call is refused and nothing planted is unpickled."""
    env = fallback_env(public_tmp)
    planted = public_tmp / "tmp" / f"fanrun-{os.getuid()}"
    victim = public_tmp / "victim"
    victim.mkdir(mode=0o700)
    marker = public_tmp / "unpickled"
    if plant == "directory":
        as_nobody(lambda: (os.mkdir(planted, 0o777), os.mkdir(planted / "runs", 0o777)))
        swapper = RunSwapper(planted / "runs", marker)
    else:
        as_nobody(lambda: os.symlink(victim, planted))
        swapper = None
    try:
        calls = str(len(RunSwapper.DELAYS_S))
        done = subprocess.run([sys.executable, "-c", FALLBACK_CALLER, calls], env=env, capture_output=True, text=True, timeout=120)
    finally:
        if swapper is not None:
            swapper.close()
    assert not marker.exists(), "a rank unpickled the payload another user planted"
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(RunSwapper.DELAYS_S) and all(line.startswith("refused: UnsafePathError:") for line in lines), done.stdout
    assert str(planted) in lines[0]
    assert ("uid 65534" if plant == "directory" else "symbolic link") in lines[0]
    assert os.listdir(victim) == []


def test_the_tmpdir_fallback_is_made_private_level_by_level(public_tmp):
    """Under $TMPDIR, fanrun-<uid> and runs are made 0700 and the call runs there, even with
    umask 0."""
    env = fallback_env(public_tmp)
    done = subprocess.run(
        [sys.executable, "-c", "import os; os.umask(0)\n" + FALLBACK_CALLER, "1"], env=env, capture_output=True, text=True, timeout=120
    )
    level = public_tmp / "tmp" / f"fanrun-{os.getuid()}"
    assert done.stdout.startswith(f"ran in {level / 'runs'}/"), done.stdout + done.stderr
    assert (mode(level), mode(level / "runs")) == (0o700, 0o700)


def test_symlinks_in_the_runs_root_are_never_followed(runs_root, tmp_path, monkeypatch):
    """Links in the runs root, even named like old runs and pointing at directories that
    look like runs, are neither followed nor removed; a directory whose marker is a link is
    not taken for a run; a runs root that is itself a link is refused."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (outside / _paths.RUN_MARKER).write_text("")
    for name in ("20000101-000000-000000-x-abcdef", "20000101-000000-x-abcdef"):
        (runs_root / name).symlink_to(outside)
    fake = runs_root / "20000101-000000-000001-y-abcdef"
    fake.mkdir(mode=0o700)
    (fake / _paths.RUN_MARKER).symlink_to(outside / "precious")
    monkeypatch.setattr(_paths, "KEEP_RUNS", 1)
    for _ in range(2):
        where_am_i.distributed()
    assert sorted(os.listdir(outside)) == sorted(["precious", _paths.RUN_MARKER])
    assert (outside / "precious").read_text() == "keep"
    assert (runs_root / "20000101-000000-000000-x-abcdef").is_symlink()
    assert fake.is_dir()

    link = tmp_path / "runs-link"
    link.symlink_to(runs_root)
    monkeypatch.setenv("FANRUN_RUNS_DIR", str(link))
    with pytest.raises(PermissionError, match="symbolic link"):
        where_am_i.distributed()


# --- Item: a rank reads its payload only from its caller's private directory ------------


def run_rank(run_dir: Path) -> subprocess.CompletedProcess:
    """One rank of a function call, started as the engine starts it, on run_dir."""
    env = {**os.environ, "FANRUN_RUN_DIR": str(run_dir), "RANK": "0"}
    env.pop("FANRUN_CONTROL_FD", None)
    return subprocess.run([sys.executable, "-u", "-c", bootstrap_code(), "function"], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "case",
    ["directory owned by uid 65534", "directory mode 0777", "payload owned by uid 65534", "payload mode 0644", "payload is a symlink", "directory is a symlink"],
)
def test_a_rank_unpickles_only_its_own_private_payload(case, tmp_path):
    """The rank opens payload.pkl through its run directory's descriptor, without following
    links, and unpickles it only when the directory is its user's and the payload a regular
    file of its user's that nobody else can read or write."""
    marker = tmp_path / "unpickled"
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    payload = run_dir / "payload.pkl"
    payload.write_bytes(planted_payload(marker))
    payload.chmod(0o600)
    target = run_dir
    if case == "directory owned by uid 65534":
        os.chown(run_dir, NOBODY, NOBODY)
    elif case == "directory mode 0777":
        run_dir.chmod(0o777)
    elif case == "payload owned by uid 65534":
        os.chown(payload, NOBODY, NOBODY)
    elif case == "payload mode 0644":
        payload.chmod(0o644)
    elif case == "payload is a symlink":
        elsewhere = tmp_path / "elsewhere.pkl"
        payload.rename(elsewhere)
        payload.symlink_to(elsewhere)
    else:
        target = tmp_path / "run-link"
        target.symlink_to(run_dir)
    done = run_rank(target)
    assert not marker.exists(), "the rank unpickled a payload that was not its caller's alone"
    assert done.returncode != 0
    assert "PermissionError" in done.stderr, done.stderr


def test_a_rank_still_reads_a_private_payload(tmp_path):
    """The same start-up on a 0700 directory with a 0600 payload of the caller's unpickles it
    (here, the planted one, to show the checks above are what stopped it)."""
    marker = tmp_path / "unpickled"
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "payload.pkl").write_bytes(planted_payload(marker))
    (run_dir / "payload.pkl").chmod(0o600)
    run_rank(run_dir)
    assert marker.exists()


# --- Item: everything fanrun writes in a runs directory is private --------------------


def test_everything_written_is_private_whatever_the_umask(runs_dir, monkeypatch):
    """Under umask 0: every level of the runs root fanrun makes and each run directory are
    0700; the payload, marker, logs and error files are 0600."""
    base = runs_dir / "umask-0"
    base.mkdir(mode=0o700)
    root = base / "made" / "by" / "fanrun"
    monkeypatch.setenv("FANRUN_RUNS_DIR", str(root))
    previous = os.umask(0)
    try:
        modes = report_modes.distributed()[0]
        with pytest.raises(ValueError):
            fails.distributed()
    finally:
        os.umask(previous)
    assert [mode(p) for p in (base / "made", base / "made" / "by", root)] == [0o700] * 3
    # ranks.json (fanrun stacks' record of the ranks) is written once they started: there or not yet.
    assert modes.pop("ranks.json", 0o600) == 0o600
    # The rank's progress record, its stacks file and its FIFO (_rank/progress.py): the stall watch's.
    forensics = {"rank_0.progress": 0o600, "rank_0.stacks": 0o600, "rank_0.ask": 0o600}
    assert modes == {"payload.pkl": 0o600, "rank_0.log": 0o600, _paths.RUN_MARKER: 0o600, **forensics}
    runs = sorted(path for path in root.iterdir() if path.name != "records")
    assert [mode(run) for run in runs] == [0o700, 0o700]
    failed = runs[-1]
    assert {p.name: mode(p) for p in failed.iterdir()} == {"rank_0.log": 0o600, "rank_0.error": 0o600,
                                                           _paths.RUN_MARKER: 0o600, **forensics}
    # The runs' records (_launch/records.py): the folder, each run's, and their files.
    kept = sorted((root / "records").iterdir())
    assert mode(root / "records") == 0o700 and [mode(record) for record in kept] == [0o700, 0o700]
    files = {name: 0o600 for name in ("state.json", "runner.json", "attempt-0.json", "end.json",
                                      "goodput.json")}
    assert [{p.name: mode(p) for p in record.iterdir()} for record in kept] == [files] * 2
