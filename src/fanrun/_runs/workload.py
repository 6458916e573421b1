"""The workload file of `fanrun submit`, with the fields of Databricks' `databricks air run -f`
where they make sense: on this machine, or with `compute.nodes` above 1 on a Ray cluster. Every
mistake is an error before anything starts, naming the file, the line and the field.

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
import numbers
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from .._accelerators import parse_accelerator_type
from .._launch.program import RankProgram

FIELDS = ("experiment_name", "command", "script", "args", "function", "kwargs", "compute", "env_variables",
          "max_retries", "timeout_minutes", "mlflow_run_name")
COMPUTE_FIELDS = ("accelerator_type", "num_accelerators", "nodes")
PROGRAM_FIELDS = ("command", "script", "function")


class WorkloadError(ValueError):
    """What is wrong with a workload file, where: `path:line: field: problem`."""


@dataclasses.dataclass
class Workload:
    name: str  # the run's name: the function's, the script's or the program's
    fields: dict[str, Any]
    program: RankProgram | None  # a script, module or program; None for a function
    payload: bytes | None  # a function's call
    options: Any  # _decorator.Options
    env: dict[str, str]
    nodes: int  # above 1: a Ray job (ray_job.py)


def load(path: str, overrides: list[str]) -> Workload:
    """The workload of the file at `path`, with `FIELD=VALUE` overrides (dotted for compute's)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as error:
        raise WorkloadError(f"{path}: cannot read the workload file: {error.strerror}") from None
    try:
        lines = _lines(yaml.compose(text), ())
        fields = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise WorkloadError(f"{path}: not valid YAML: {error}") from None
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
        target[keys[-1]] = yaml.safe_load(value)
        where.overridden.add(keys)
    return _check(fields, where, Path(path).resolve().parent)


class _Where:
    def __init__(self, path: str, lines: dict[tuple, int]) -> None:
        self.path = path
        self.lines = lines
        self.overridden: set[tuple] = set()

    def error(self, keys: tuple, problem: str) -> WorkloadError:
        field = ".".join(keys)
        if keys in self.overridden:
            return WorkloadError(f"--override {field}: {problem}")
        line = self.lines.get(keys) or self.lines.get(keys[:1]) or 1
        return WorkloadError(f"{self.path}:{line}: {field}: {problem}")


def _lines(node, keys: tuple) -> dict[tuple, int]:
    """The line of every key of the mapping node, nested ones too."""
    lines: dict[tuple, int] = {}
    if getattr(node, "tag", "").endswith(":map"):
        for key, value in node.value:
            path = (*keys, key.value)
            lines[path] = key.start_mark.line + 1
            lines.update(_lines(value, path))
    return lines


def _check(fields: dict, where: _Where, base: Path) -> Workload:
    from .. import _decorator, _payload

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
        raise where.error(("compute",), "must be a mapping of accelerator_type, num_accelerators and nodes")
    for key in compute:
        if key not in COMPUTE_FIELDS:
            raise where.error(("compute", key), f"not a compute field; they are {', '.join(COMPUTE_FIELDS)}")
    count = compute.get("num_accelerators")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise where.error(("compute", "num_accelerators"), f"must be a positive whole number, not {count!r}")
    nodes = compute.get("nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise where.error(("compute", "nodes"), f"must be a positive whole number of machines, not {nodes!r}")
    if nodes > 1 and count is not None and count % nodes:
        raise where.error(("compute", "num_accelerators"), f"{count} ranks cannot be spread evenly over {nodes} nodes; "
                                                            f"give a multiple of {nodes}")
    try:
        accelerator = parse_accelerator_type(compute.get("accelerator_type"))
    except (TypeError, ValueError) as error:
        raise where.error(("compute", "accelerator_type"), str(error)) from None
    env = fields.get("env_variables") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and k for k in env):
        raise where.error(("env_variables",), "must be a mapping of variable names to values")
    env = {key: "" if value is None else str(value) for key, value in env.items()}
    retries = fields.get("max_retries", 0)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise where.error(("max_retries",), f"must be a whole number, 0 or more, not {retries!r}")
    minutes = fields.get("timeout_minutes")
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, numbers.Real) or not minutes > 0):
        raise where.error(("timeout_minutes",), f"must be a positive number of minutes, not {minutes!r}")
    for key in ("experiment_name", "mlflow_run_name"):
        if fields.get(key) is not None and (not isinstance(fields[key], str) or not fields[key].strip()):
            raise where.error((key,), f"must be a non-empty string, not {fields[key]!r}")
    options = _decorator.Options(
        num_accelerators=count, accelerator=accelerator,
        timeout=None if minutes is None else float(minutes) * 60,
        experiment_name=fields.get("experiment_name"), run_name=fields.get("mlflow_run_name"),
        max_restarts=retries, nodes=nodes if nodes > 1 else None,
    )
    name, program, payload = _program(fields, where, base, _payload)
    return Workload(name=name, fields=fields, program=program, payload=payload, options=options, env=env, nodes=nodes)


def from_fields(fields: dict, base: Path) -> Workload:
    """The workload of fields checked once already (load), in `base`: a Ray job's (ray_driver.py)."""
    return _check(fields, _Where("workload", {}), base)


def _program(fields: dict, where: _Where, base: Path, payload_module) -> tuple[str, RankProgram | None, bytes | None]:
    for key in ("args", "kwargs"):
        owner = "script" if key == "args" else "function"
        if fields.get(key) is not None and fields.get(owner) is None:
            raise where.error((key,), f"goes with {owner}:, which this workload does not give")
    if fields.get("function") is not None:
        spec = fields["function"]
        module_name, colon, attribute = str(spec).partition(":")
        if not colon or not module_name or not attribute:
            raise where.error(("function",), f"write module:name, such as train:main, not {spec!r}")
        kwargs = fields.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise where.error(("kwargs",), "must be a mapping of argument names to values")
        # The workload's folder first, as `python -c "from train import main"` run there would find it.
        sys.path.insert(0, str(base))
        try:
            function = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise where.error(("function",), f"{spec!r} cannot be found: {error}") from None
        function = getattr(function, "__wrapped__", function)  # a @distributed function: its own body
        if not callable(function):
            raise where.error(("function",), f"{spec!r} is not a function")
        return attribute, None, payload_module.serialize_call(function, (), kwargs)
    if fields.get("script") is not None:
        script = base / str(fields["script"])
        if not script.is_file():
            raise where.error(("script",), f"{script} does not exist")
        args = fields.get("args") or []
        if not isinstance(args, list):
            raise where.error(("args",), "must be a list of arguments")
        return script.name, RankProgram.script(str(script), [str(a) for a in args]), None
    try:
        argv = shlex.split(str(fields["command"]))
    except ValueError as error:
        raise where.error(("command",), f"cannot be split into arguments: {error}") from None
    if not argv:
        raise where.error(("command",), "is empty")
    if os.path.basename(argv[0]).startswith("python") and len(argv) > 1:
        if argv[1] == "-m" and len(argv) > 2:
            return argv[2], RankProgram.script(argv[2], argv[3:], module=True), None
        script = base / argv[1]
        if not script.is_file():
            raise where.error(("command",), f"the script {script} does not exist")
        return script.name, RankProgram.script(str(script), argv[2:]), None
    return os.path.basename(argv[0]), RankProgram.native(argv), None
