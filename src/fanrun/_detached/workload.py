"""The workload file of `fanrun submit`, with the fields of Databricks' `databricks air run -f`
where they make sense: on this machine, or with `compute.nodes` above 1 on a Ray cluster or (with
`compute.backend: slurm`, or inside a Slurm allocation) on Slurm's nodes. Every mistake is an error
before anything starts, naming the file, the line and the field.

    experiment_name: my-experiment
    command: python train.py --lr 3e-4      # or: script: train.py + args: [...]
                                            # or: function: train:main + kwargs: {...}
    compute: {accelerator_type: GPU_2xH200, num_accelerators: 2, nodes: 1}
    env_variables: {WANDB_MODE: offline}
    max_retries: 2
    timeout_minutes: 120
    mlflow_run_name: first-try
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from .._accelerators import parse_accelerator_type
from .._spec.program import RankProgram
from .._spec.spec import Options
from . import workload_command, workload_yaml
from .workload_yaml import WorkloadError as WorkloadError

FIELDS = ("experiment_name", "command", "script", "args", "function", "kwargs", "compute", "env_variables",
          "max_retries", "timeout_minutes", "mlflow_run_name")
COMPUTE_FIELDS = ("accelerator_type", "num_accelerators", "nodes", "backend", "slurm")
CLUSTERS = ("ray", "slurm")
PROGRAM_FIELDS = ("command", "script", "function")
# A year: a longer timeout is a mistake in the unit; leaving the field out means no timeout.
MAX_TIMEOUT_MINUTES = 365 * 24 * 60


@dataclasses.dataclass
class Workload:
    name: str  # the run's name: the function's, the script's or the program's
    fields: dict[str, Any]
    program: RankProgram | None  # a script, module or program; None for a function
    payload: bytes | None  # a function's call
    options: Options
    env: dict[str, str]
    nodes: int  # above 1: a Ray job (ray_job.py), or a detached run of Slurm's nodes (backend "slurm")
    shown: str  # what every rank runs, as --dry-run shows it
    backend: str | None = None


def spec_of(workload: Workload):
    """The workload as the call path runs it on this machine, checked against it (_launch/call.py)."""
    from .._launch import call

    return call.plan(workload.name, workload.options, workload.program or RankProgram.function(),
                     payload=workload.payload, env=workload.env)


def load(path: str, overrides: list[str]) -> Workload:
    """The workload of the file at `path`, with `FIELD=VALUE` overrides (dotted for compute's)."""
    fields, lines = workload_yaml.read(path)
    if not isinstance(fields, dict):
        raise WorkloadError(f"{path}:1: a workload file is a mapping of fields ({', '.join(FIELDS)})")
    where = _Where(path, lines)
    for override in overrides:
        name, equals, value = override.partition("=")
        if not equals or not name:
            raise WorkloadError(f"--override {override!r}: write FIELD=VALUE, such as compute.num_accelerators=4")
        keys = tuple(name.split("."))
        target = fields
        for key in keys[:-1]:
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                raise WorkloadError(f"--override {override!r}: {key} is not a mapping")
        target[keys[-1]] = workload_yaml.parse_value(value, f"--override {override!r}")
        where.overridden.add(keys)
    return _check(fields, where, Path(path).resolve().parent)


class _Where:
    def __init__(self, path: str, lines: dict[tuple, int]) -> None:
        self.path = path
        self.lines = lines
        self.overridden: set[tuple] = set()

    def error(self, keys: tuple, problem: str) -> WorkloadError:
        field = workload_yaml.dotted(keys)
        problem = problem.replace("\n", "\\n")  # one line, whatever a value or an import error holds
        if any(keys[:length] in self.overridden for length in range(1, len(keys) + 1)):
            return WorkloadError(f"--override {field}: {problem}")
        line = next((self.lines[keys[:length]] for length in range(len(keys), 0, -1) if keys[:length] in self.lines), 1)
        return WorkloadError(f"{self.path}:{line}: {field}: {problem}")


def _check(fields: dict, where: _Where, base: Path) -> Workload:
    """Every field's type and range, in one place, before anything is imported or started."""
    from .._spec import payload as _payload

    for key in fields:
        if key not in FIELDS:
            raise where.error((key,), f"not a workload field; the fields are {', '.join(FIELDS)}")
    given = [key for key in PROGRAM_FIELDS if fields.get(key) is not None]
    if len(given) != 1:
        shown = " and ".join(given) if given else "none of them"
        raise where.error((given[1],) if len(given) > 1 else ("command",),
                          f"a workload runs one of command, script or function; this one gives {shown}")
    compute = fields.get("compute") or {}
    if not isinstance(compute, dict):
        raise where.error(("compute",), f"must be a mapping of {', '.join(COMPUTE_FIELDS)}")
    for key in compute:
        if key not in COMPUTE_FIELDS:
            raise where.error(("compute", key), f"not a compute field; they are {', '.join(COMPUTE_FIELDS)}")
    count = compute.get("num_accelerators")
    if count is not None and not _whole(count, 1):
        raise where.error(("compute", "num_accelerators"), f"must be a positive whole number, not {count!r}")
    nodes = compute.get("nodes", 1)
    if not _whole(nodes, 1):
        raise where.error(("compute", "nodes"), f"must be a positive whole number of machines, not {nodes!r}")
    if nodes > 1 and count is not None and count % nodes:
        raise where.error(("compute", "num_accelerators"), f"{count} ranks cannot be spread evenly over {nodes} nodes; "
                                                            f"give a multiple of {nodes}")
    try:
        accelerator = parse_accelerator_type(compute.get("accelerator_type"))
    except (TypeError, ValueError) as error:
        raise where.error(("compute", "accelerator_type"), str(error)) from None
    backend, slurm = _cluster(compute, nodes, where)
    env = _environment(fields.get("env_variables"), where)
    retries = fields.get("max_retries", 0)
    if not _whole(retries, 0):
        raise where.error(("max_retries",), f"must be a whole number, 0 or more, not {retries!r}")
    minutes = fields.get("timeout_minutes")
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, numbers.Real)
                                or not math.isfinite(minutes) or not 0 < minutes <= MAX_TIMEOUT_MINUTES):
        raise where.error(("timeout_minutes",), f"must be a finite number of minutes above 0, at most "
                                                f"{MAX_TIMEOUT_MINUTES}; leave it out for no timeout, not {minutes!r}")
    for key in ("experiment_name", "mlflow_run_name"):
        if fields.get(key) is not None and (not isinstance(fields[key], str) or not fields[key].strip()):
            raise where.error((key,), f"must be a non-empty string, not {fields[key]!r}")
    for key, owner in (("args", "script"), ("kwargs", "function")):
        if fields.get(key) is not None and fields.get(owner) is None:
            raise where.error((key,), f"goes with {owner}:, which this workload does not give")
    for key in ("script", "function"):
        if fields.get(key) is not None and not isinstance(fields[key], str):
            raise where.error((key,), f"must be a string, not {fields[key]!r}")
        if fields.get(key) is not None:
            _text(fields[key], (key,), where)  # NUL
    args = fields.get("args") or []
    if not isinstance(args, list):
        raise where.error(("args",), "must be a list of arguments")
    for index, arg in enumerate(args):
        _text(arg, ("args", index), where)
    kwargs = fields.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise where.error(("kwargs",), "must be a mapping of argument names to values")
    if fields.get("command") is not None:
        env.setdefault("PATH", _path_with_this_python())
        program = workload_command.rank_program(
            fields["command"], env["PATH"], lambda keys, problem: where.error(("command", *keys), problem))
        name, payload, shown = workload_command.name(fields["command"]), None, workload_command.shown(program)
    options = Options(
        num_accelerators=count, accelerator=accelerator,
        timeout=None if minutes is None else float(minutes) * 60,
        experiment_name=fields.get("experiment_name"), run_name=fields.get("mlflow_run_name"),
        max_restarts=retries, nodes=nodes if nodes > 1 else None, backend=backend, slurm=slurm,
    )
    if fields.get("command") is None:  # last: a function's module is imported, the one step that runs user code
        name, program, payload, shown = _program(fields, where, base, _payload)
    return Workload(name=name, fields=fields, program=program, payload=payload, options=options, env=env, nodes=nodes,
                    shown=shown, backend=backend)


def _cluster(compute: dict, nodes: int, where) -> tuple[str | None, dict[str, str] | None]:
    """compute.backend and compute.slurm: where more than one node runs. By default Slurm inside an
    allocation, else Ray."""
    from ..backends.slurm.allocation import check_options, in_allocation

    backend = compute.get("backend")
    if backend is not None and backend not in CLUSTERS:
        raise where.error(("compute", "backend"), f"must be one of {', '.join(CLUSTERS)}, not {backend!r}")
    if backend is None and nodes > 1:
        backend = "slurm" if in_allocation() else None
    if compute.get("slurm") is not None and backend != "slurm":
        raise where.error(("compute", "slurm"), "gives srun's options, and this workload does not run on Slurm: "
                                                "add backend: slurm, or drop slurm")
    try:
        slurm = check_options(compute.get("slurm"))
    except (TypeError, ValueError) as error:
        raise where.error(("compute", "slurm"), str(error)) from None
    return backend, (slurm if backend == "slurm" else None)


def _whole(value: Any, least: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


def _text(value: Any, keys: tuple, where: _Where) -> str:
    """A value that reaches a process (an argument, a variable) as its text; NUL cannot."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise where.error(keys, f"must be a string or a number, not {value!r}; write it in quotes")
    text = str(value)
    if "\0" in text:
        raise where.error(keys, "holds a NUL character, which cannot reach a program; remove it")
    return text


def _environment(variables: Any, where: _Where) -> dict[str, str]:
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise where.error(("env_variables",), "must be a mapping of variable names to values")
    env = {}
    for key, value in variables.items():
        if not key:
            raise where.error(("env_variables", key), "a variable's name cannot be empty")
        if "=" in key:
            raise where.error(("env_variables", key), f"a variable's name cannot hold '=': the environment would "
                                                      f"read it as {key.split('=', 1)[0]!r}; fix the name")
        if "\0" in key:
            raise where.error(("env_variables", key), "holds a NUL character, which cannot reach a program; remove it")
        env[key] = "" if value is None else _text(value, ("env_variables", key), where)
    return env


def _path_with_this_python() -> str:
    """The ranks' PATH for a command: this interpreter's folder first, as an activated virtual
    environment has it, so that `python` there is the one fanrun runs under, with fanrun in it."""
    folder = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    return path if path.split(os.pathsep, 1)[0] == folder else f"{folder}{os.pathsep}{path}" if path else folder


def from_fields(fields: dict, base: Path) -> Workload:
    """The workload of fields checked once already (load), in `base`: a Ray job's (ray_driver.py)."""
    return _check(fields, _Where("workload", {}), base)


def _program(fields: dict, where: _Where, base: Path,
             payload_module) -> tuple[str, RankProgram | None, bytes | None, str]:
    """A function's or a script's (name, program, payload, what --dry-run shows), their types checked already."""
    if fields.get("function") is not None:
        spec = fields["function"]
        module_name, colon, attribute = spec.partition(":")
        if not colon or not module_name or not attribute:
            raise where.error(("function",), f"write module:name, such as train:main, not {spec!r}")
        kwargs = fields.get("kwargs") or {}
        # The workload's folder first, as `python -c "from train import main"` run there would find it.
        sys.path.insert(0, str(base))
        try:
            function = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise where.error(("function",), f"{spec!r} cannot be found: {error}") from None
        except Exception as error:  # noqa: BLE001 - the module's own error at import, named here
            raise where.error(("function",), f"importing {module_name!r} raised {type(error).__name__}: {error}") from None
        function = getattr(function, "__wrapped__", function)  # a @distributed function: its own body
        if not callable(function):
            raise where.error(("function",), f"{spec!r} is not a function")
        return attribute, None, payload_module.serialize_call(function, (), kwargs), f"{spec}(**{kwargs})"
    script = base / fields["script"]
    if not script.is_file():
        raise where.error(("script",), f"{script} does not exist")
    args = [str(arg) for arg in fields.get("args") or []]
    return script.name, RankProgram.script(str(script), args), None, shlex.join(["python", str(script), *args])
