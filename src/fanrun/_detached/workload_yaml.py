"""A workload file's YAML, read safely: UTF-8 text of a bounded size, no aliases (nine lines of
anchors and aliases expand to gigabytes, and an anchor can contain itself), every key a string
given once. Each problem is one line that names the file and the line."""

from __future__ import annotations

from typing import Any, Callable

import yaml

# A workload file is a few dozen lines; anything near this is not one.
MAX_BYTES = 1 << 20
_STR_TAG = "tag:yaml.org,2002:str"


class WorkloadError(ValueError):
    """What is wrong with a workload file, where: `path:line: field: problem`, on one line."""


def dotted(keys: tuple) -> str:
    """A field's name as the file spells its place: compute.nodes, args[1]."""
    text = ""
    for key in keys:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text


def read(path: str) -> tuple[Any, dict[tuple, int]]:
    """The file's document and the line of every key and list item in it, nested ones too."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_BYTES + 1)
    except OSError as error:
        raise WorkloadError(f"{path}: cannot read the workload file: {error.strerror}") from None
    if len(data) > MAX_BYTES:
        raise WorkloadError(f"{path}: larger than {MAX_BYTES >> 20} MiB: not a workload file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise WorkloadError(f"{path}:{line}: not UTF-8 text (byte {data[error.start]:#04x}); save the file as "
                            f"UTF-8") from None
    lines: dict[tuple, int] = {}
    document = _load(text, lambda line: f"{path}:{line}", lines)
    return document, lines


def parse_value(text: str, label: str) -> Any:
    """The value of an `--override FIELD=VALUE`, read as the file's values are; `label` names it."""
    return _load(text, lambda line: label, {})


class _AliasRefused(yaml.MarkedYAMLError):
    pass


class _Loader(yaml.SafeLoader):
    """SafeLoader that stops at the first alias, before it is expanded anywhere."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasRefused(problem=f"aliases (*{event.anchor}) are not accepted in a workload file: write "
                                        f"the value out where it is used", problem_mark=event.start_mark)
        return super().compose_node(parent, index)


def _load(text: str, where: Callable[[int], str], lines: dict[tuple, int]) -> Any:
    loader = None
    try:
        loader = _Loader(text)  # reading it checks every character already
        node = loader.get_single_node()
        if node is None:
            return None
        _check_keys(node, (), where, lines)
        return loader.construct_document(node)
    except _AliasRefused as error:
        raise WorkloadError(f"{where(error.problem_mark.line + 1)}: {error.problem}") from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        context = f" ({error.context})" if error.context and error.problem else ""
        problem = " ".join(f"{error.problem or error.context}{context}".split())
        raise WorkloadError(f"{where(mark.line + 1 if mark else 1)}: not valid YAML: {problem}") from None
    except yaml.reader.ReaderError as error:
        line = text[: error.position].count("\n") + 1
        raise WorkloadError(f"{where(line)}: not valid YAML: the character #x{error.character:04x} is not allowed "
                            f"in YAML; write it as an escape in double quotes") from None
    except yaml.YAMLError as error:
        raise WorkloadError(f"{where(1)}: not valid YAML: {' '.join(str(error).split())}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_keys(node: yaml.Node, keys: tuple, where: Callable[[int], str], lines: dict[tuple, int]) -> None:
    """Every key a string, given once; records the line of each key and list item."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _STR_TAG:
                shown = key_node.value if isinstance(key_node, yaml.ScalarNode) else "a list or mapping"
                raise WorkloadError(f"{where(line)}: {dotted((*keys, shown))}: a key must be a string, not "
                                    f"{_kind(key_node)}; write it in quotes if it is a name")
            path = (*keys, key_node.value)
            if path in lines:
                raise WorkloadError(f"{where(line)}: {dotted(path)}: given twice (also on line {lines[path]}); "
                                    f"keep one")
            lines[path] = line
            _check_keys(value_node, path, where, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*keys, index)] = item.start_mark.line + 1
            _check_keys(item, (*keys, index), where, lines)


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode):
        return f"{node.tag.rsplit(':', 1)[-1]} {node.value}"
    return "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"
