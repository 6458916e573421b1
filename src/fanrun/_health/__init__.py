"""The GPU health gate: before any rank of a GPU call starts, NVML's answers for every GPU it will
use are judged (gate.py), and with health="deep" every GPU does a few seconds of work that is
compared with what its model should reach (deep.py, figures.py). check.py is what the call path
holds; reader.py keeps NVML open between calls."""
