"""Deletion vectors written into a Delta table's log by hand, in the format of the Delta protocol
(PROTOCOL.md, "Deletion Vector Format"), since delta-rs deletes by rewriting files: an inline
vector (storage type "i"), Z85-encoded, holding a RoaringBitmapArray of one portable 32-bit
roaring bitmap of array containers."""

from __future__ import annotations

import json
import os
import struct
import time

Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
ROARING_ARRAY_MAGIC = 1681511377
NO_RUN_CONTAINERS = 12346


def z85(data: bytes) -> str:
    data += b"\0" * (-len(data) % 4)
    out = []
    for i in range(0, len(data), 4):
        value = int.from_bytes(data[i:i + 4], "big")
        digits = []
        for _ in range(5):
            value, digit = divmod(value, 85)
            digits.append(Z85[digit])
        out.extend(reversed(digits))
    return "".join(out)


def roaring_bitmap(rows: list[int]) -> bytes:
    containers: dict[int, list[int]] = {}
    for row in sorted(rows):
        containers.setdefault(row >> 16, []).append(row & 0xFFFF)
    keys = sorted(containers)
    header = struct.pack("<II", NO_RUN_CONTAINERS, len(keys))
    header += b"".join(struct.pack("<HH", key, len(containers[key]) - 1) for key in keys)
    offsets, body = b"", b""
    first = len(header) + 4 * len(keys)
    for key in keys:
        offsets += struct.pack("<I", first + len(body))
        body += b"".join(struct.pack("<H", value) for value in containers[key])
    return header + offsets + body


def deletion_vector(rows: list[int]) -> dict:
    data = struct.pack("<iqi", ROARING_ARRAY_MAGIC, 1, 0) + roaring_bitmap(rows)
    return {"storageType": "i", "pathOrInlineDv": z85(data), "sizeInBytes": len(data), "cardinality": len(rows)}


def live_files(table: str) -> list[dict]:
    """The add actions of the table's latest version, replayed from its log."""
    log = os.path.join(table, "_delta_log")
    files: dict[str, dict] = {}
    for name in sorted(n for n in os.listdir(log) if n.endswith(".json")):
        with open(os.path.join(log, name)) as commit:
            for action in map(json.loads, commit):
                if "add" in action:
                    files[action["add"]["path"]] = action["add"]
                elif "remove" in action:
                    files.pop(action["remove"]["path"], None)
    return list(files.values())


def delete_rows(table: str, add: dict, rows: list[int]) -> int:
    """Commits a deletion vector that removes `rows` (positions in the file) of `add`'s file."""
    log = os.path.join(table, "_delta_log")
    version = max(int(n.split(".")[0]) for n in os.listdir(log) if n.endswith(".json")) + 1
    now = int(time.time() * 1000)
    removed = {"path": add["path"], "deletionTimestamp": now, "dataChange": True, "extendedFileMetadata": True,
               "partitionValues": add["partitionValues"], "size": add["size"]}
    added = {**add, "modificationTime": now, "dataChange": True, "deletionVector": deletion_vector(rows)}
    with open(os.path.join(log, f"{version:020d}.json"), "x") as commit:
        for action in ({"commitInfo": {"timestamp": now, "operation": "DELETE"}}, {"remove": removed}, {"add": added}):
            commit.write(json.dumps(action) + "\n")
    return version
