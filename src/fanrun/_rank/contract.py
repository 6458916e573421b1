"""The run contract, Python's half: the files of a run's directory, the environment fanrun gives
every rank, and the messages a rank sends the engine on its control channel.

The engine's half is cpp/include/fanrun/run_contract.h, which fanrun._core hands over as its
CONTROL_* constants and its EventKind, Stream, SegmentKind and StopReason enums;
tests/test_run_contract.py holds the two halves equal. A rank's worker loads this file by
path, before anything else: it imports the standard library alone.
"""

import signal

# In a run's directory (_spec/paths.py's RunPaths makes it).
# The call, written by the caller: a pickled header (the caller's sys.path), then the pickled
# (function, args, kwargs).
PAYLOAD = "payload.pkl"
# Marks the directory as a run of fanrun's, and is locked (flock) while its call lasts.
RUN_MARKER = ".fanrun-run"


def result_name(rank: int) -> str:
    """The rank's return value, in result_file.py's format; written by the rank."""
    return f"rank_{rank}.result"


def error_name(rank: int) -> str:
    """The rank's error envelope (a pickled dict, worker.py's _fail); written by the rank when it fails."""
    return f"rank_{rank}.error"


# The keys of a rank's error envelope, a pickled dict: "kind" is one of ENVELOPE_KINDS (a raised
# exception, sys.exit with a code, a return value that cannot be pickled); "exception" is the
# pickled exception or None; "frames" are (file, line, function) for the caller to format with
# its own source; "exit_code" is sys.exit's code or None.
ENVELOPE_KEYS = ("kind", "rank", "pid", "time", "type", "message", "traceback", "frames", "exception_only",
                 "exit_code", "result_type", "exception")
ENVELOPE_KINDS = ("exception", "exit", "result")

# Sent to a rank to dump every thread's Python stack into its log (faulthandler) without
# stopping it: by the engine at a timeout, by `fanrun stacks` at any time.
STACK_DUMP_SIGNAL = signal.SIGUSR2


def panel_metrics_name(rank: int) -> str:
    """The metric points the rank logged, one "key<TAB>step<TAB>value" line each, for the caller's
    live panel; written by the rank only where ENV_PANEL_METRICS is set."""
    return f"rank_{rank}.metrics.tsv"


def log_name(rank: int) -> str:
    """Everything the rank wrote to stdout and stderr, byte for byte; written by the engine."""
    return f"rank_{rank}.log"


# fanrun's variables in every rank's environment, besides torchrun's.
ENV_RUN_ID = "FANRUN_RUN_ID"  # the run's id: shared by its ranks and their restarts, and by nothing else
ENV_RUN_DIR = "FANRUN_RUN_DIR"  # the run's directory
ENV_CONTROL_FD = "FANRUN_CONTROL_FD"  # CONTROL_FD, where the engine gave the rank its control channel
ENV_ACCELERATOR = "FANRUN_ACCELERATOR"  # "gpu" or "cpu"
ENV_NODE_ID = "FANRUN_NODE_ID"  # the cluster's id of the rank's node (Ray's node id); unset on one machine
ENV_TRACKING = "FANRUN_MLFLOW"  # what the rank's MLflow does (_rank/tracking.py); unset outside @distributed
ENV_SPARE = "FANRUN_SPARE_OF"  # in a spare rank's first environment: the pid of the caller it waits for
ENV_RESTART_COUNT = "FANRUN_RESTART_COUNT"  # which attempt this is: 0, then 1 after the first restart (max_restarts)
ENV_MAX_RESTARTS = "FANRUN_MAX_RESTARTS"  # how many restarts the call allows
ENV_PANEL_METRICS = "FANRUN_PANEL_METRICS"  # "1": the caller's panel plots the metrics the rank logs
ENV_KEEP_ALIVE = "FANRUN_KEEP_ALIVE"  # "1": a spare rank that ends its call well stays for the next (CONTROL_KEPT)

# The control channel: a pipe at this descriptor in every rank, one message a line.
CONTROL_FD = 3
# "My error is written, I am failing": the engine stops the other ranks at once.
CONTROL_FAILED = "failed"
# "My result is written": a function's rank that exits without it has failed.
CONTROL_DONE = "done"
# Followed by the length in decimal and a newline, then that many bytes, which go to the rank's
# log alone: the traceback of its failure, which the caller shows with its exception.
CONTROL_LOG = "log "
# The other way, to a spare rank (_rank/spare.py), whose control channel is a socket: the call it
# becomes. This word, the body's length in decimal and a newline, with the rank's stdout and
# stderr attached (SCM_RIGHTS); then the body: its directory, the count of its argv, its argv and
# its environment, each string ended by a NUL.
SPARE_CALL = "call "
# A spare rank's one line before its call: its imports are done.
SPARE_READY = "ready"
# From a rank that was a spare, after CONTROL_DONE: "my output is flushed, my stdout and stderr
# are no longer the call's, and I wait on my control channel for another call".
CONTROL_KEPT = "kept"

# A rank's output streams, numbered as their descriptors: the engine reports each piece of
# output with one of them (fanrun._core.Stream, whose STDOUT and STDERR equal these).
STDOUT = 1
STDERR = 2
