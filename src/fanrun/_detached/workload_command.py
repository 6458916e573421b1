"""A workload's `command:` as what every rank runs. A string is a shell command, as Databricks'
workload files have it: run with `bash -e -o pipefail -c`, so every line runs and the first line
or pipe that fails fails the rank. A list is an argv, run as it is, with no shell.

A command that is itself a launcher (torchrun, `python -m torch.distributed.run`, `accelerate
launch`, `deepspeed`) is refused, with what to write instead: every rank runs the command, so a
launcher there would start a world of its own on every rank. fanrun is the launcher: it starts
one rank per accelerator with torchrun's environment, which those libraries read.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from typing import Callable

from .._spec.program import RankProgram

SHELL = ("bash", "-e", "-o", "pipefail", "-c")

# torchrun's flags that take no value; every other flag takes one (--flag VALUE or --flag=VALUE).
_TORCHRUN_SWITCHES = {"--standalone", "--no-python", "--no_python", "-m", "--module", "--run-path", "--run_path"}
_TORCHRUN_MODULES = {"torch.distributed.run", "torch.distributed.launch"}
_OTHER_LAUNCHER_MODULES = {"accelerate.commands.launch": "accelerate launch", "deepspeed.launcher.runner": "deepspeed",
                           "deepspeed": "deepspeed"}
# Words after which the shell reads a command's name, and words that run the command after them.
_BEFORE_A_COMMAND = {"if", "then", "else", "elif", "do", "while", "until", "!", "{", "exec", "time", "nohup",
                     "command", "builtin", "env"}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = set(";&|()\n")

Problem = Callable[[tuple, str], Exception]  # (keys below command, problem) -> the error to raise


def rank_program(command: object, path_var: str, problem: Problem) -> RankProgram:
    """What every rank runs for `command` (a string or a list), with `path_var` as the ranks' PATH."""
    if isinstance(command, str):
        return _shell(command, path_var, problem)
    if isinstance(command, list):
        return _argv(command, problem)
    raise problem((), f"must be a shell command (a string) or an argv (a list of strings), not {command!r}")


def name(command: str | list[str]) -> str:
    """The run's name: its program's, or its script's for `python train.py`; a shell command's
    last command's (the lines before it mostly prepare it)."""
    words = (_simple_commands(command) or [(1, ["command"])])[-1][1] if isinstance(command, str) else command
    named = words[1] if os.path.basename(words[0]).startswith("python") and len(words) > 1 else words[0]
    return os.path.basename(named) or "command"


def shown(program: RankProgram) -> str:
    """The command line of a command's program, as a shell would take it back."""
    return shlex.join(program.argv)


def _shell(script: str, path_var: str, problem: Problem) -> RankProgram:
    if "\0" in script:
        raise problem((), "holds a NUL character, which cannot reach a program; remove it")
    if not script.strip():
        raise problem((), "is empty")
    bash = shutil.which("bash", path=path_var)
    if bash is None:
        raise problem((), f"a command string runs in bash, which is not on PATH ({path_var}); give command as "
                          f"a list, an argv such as [python, train.py]")
    # bash's own reading of it, before any rank starts: a quote left open is an error here.
    checked = subprocess.run([bash, "-n", "-c", script], stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if checked.returncode != 0:
        first = (checked.stderr.strip().splitlines() or ["(no message)"])[0]
        raise problem((), f"is not a bash script bash can run: {first.removeprefix('bash: -c: ')}")
    whole = not _has_shell_syntax(script.strip())
    for line, words in _simple_commands(script):
        _refuse_launcher(words, problem, line=None if whole else line)
    return RankProgram.native([*SHELL, script])


def _argv(argv: list, problem: Problem) -> RankProgram:
    if not argv:
        raise problem((), "is empty")
    for index, word in enumerate(argv):
        if not isinstance(word, str):
            raise problem((index,), f"must be a string, not {word!r}; write it in quotes")
        if "\0" in word:
            raise problem((index,), "holds a NUL character, which cannot reach a program; remove it")
    _refuse_launcher(argv, problem, line=None)
    return RankProgram.native(list(argv))


def _simple_commands(script: str) -> list[tuple[int, list[str]]]:
    """The line and the words of each simple command of a shell script, from its name on, as far
    as shlex can tell them apart; what it cannot read (bash has read it already) is left out."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|()\n")
    lexer.whitespace = " \t\r"
    lexer.commenters = "#"
    commands: list[tuple[int, list[str]]] = [(1, [])]
    line = 1
    try:
        for token in lexer:
            if token and set(token) <= _SEPARATORS:
                line += token.count("\n")
                commands.append((line, []))
            elif commands[-1][1] or not (token in _BEFORE_A_COMMAND or _ASSIGNMENT.match(token)):
                commands[-1][1].append(token)
    except ValueError:
        pass
    return [(line, words) for line, words in commands if words]


def _has_shell_syntax(script: str) -> bool:
    return any(character in script for character in ";&|()<>$`\n")


def _refuse_launcher(argv: list[str], problem: Problem, *, line: int | None) -> None:
    """`line`: the line of the script that runs argv; None where argv is the whole command."""
    found = _launcher(argv)
    if found is None:
        return
    name, instead, ranks = found
    where = "" if line is None else f"its line {line} runs {name}: "
    why = (f"{where}{name} starts its own ranks, and every rank runs the command: each would start a world of its own. "
           f"fanrun is the launcher: it starts one rank per accelerator (compute.num_accelerators) with torchrun's "
           f"environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)")
    count = f", with compute.num_accelerators: {ranks}" if ranks is not None and ranks.isdigit() else ""
    if instead is None:
        readers = "" if name.endswith("torchrun") or "torch.distributed" in name else f": {name} reads that environment"
        raise problem((), f"{why}; write the script's own command instead, such as `command: python train.py "
                          f"...`{count}{readers}")
    if line is not None:
        raise problem((), f"{why}; write `{instead}` in place of that {name}{count}")
    raise problem((), f"{why}; write `command: {instead}`{count}")


def _launcher(argv: list[str]) -> tuple[str, str | None, str | None] | None:
    """(the launcher's name, the command its ranks would run, its rank count) if argv is a launcher."""
    program = os.path.basename(argv[0])
    if program == "torchrun":
        return ("torchrun", *_torchrun_target(argv[1:]))
    if program == "deepspeed":
        return "deepspeed", None, None
    if program == "accelerate" and argv[1:2] == ["launch"]:
        return "accelerate launch", None, None
    if program.startswith("python"):
        module, rest = _python_module(argv[1:])
        if module in _TORCHRUN_MODULES:
            return (f"python -m {module}", *_torchrun_target(rest))
        if module in _OTHER_LAUNCHER_MODULES:
            return _OTHER_LAUNCHER_MODULES[module], None, None
    return None


def _python_module(args: list[str]) -> tuple[str | None, list[str]]:
    """The module of `python [options] -m MODULE ...` and the words after it."""
    index = 0
    while index < len(args) and args[index].startswith("-"):
        option = args[index]
        if option == "-m":
            return (args[index + 1], args[index + 2:]) if index + 1 < len(args) else (None, [])
        if option.startswith("-m"):
            return option[2:], args[index + 1:]
        if option.startswith("-c") or option == "-":
            return None, []
        index += 2 if option in ("-W", "-X") else 1
    return None, []


def _torchrun_target(args: list[str]) -> tuple[str | None, str | None]:
    """torchrun's script or module with its arguments, as a command of its own; its --nproc-per-node."""
    index, module, no_python, ranks = 0, False, False, None
    while index < len(args) and args[index].startswith("-"):
        flag, equals, value = args[index].partition("=")
        if flag == "--":
            index += 1
            break
        if flag in _TORCHRUN_SWITCHES:
            module |= flag in ("-m", "--module")
            no_python |= flag in ("--no-python", "--no_python")
            index += 1
            continue
        if not equals:
            value = args[index + 1] if index + 1 < len(args) else ""
            index += 1
        index += 1
        if flag in ("--nproc-per-node", "--nproc_per_node"):
            ranks = value
    if index >= len(args):
        return None, ranks
    target, rest = args[index], args[index + 1:]
    command = [target, *rest] if no_python else ["python", "-m", target, *rest] if module else ["python", target, *rest]
    return shlex.join(command), ranks
