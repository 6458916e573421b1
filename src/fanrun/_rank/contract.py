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
# Sent by the stall watch to gather a rank's stacks into forensics_stacks_name(rank) instead.
FORENSICS_SIGNAL = signal.SIGRTMIN + 4
# Sent by the engine, after another rank's failure, to a rank whose call may restart in the same
# process (ENV_KEEP_SURVIVORS): it abandons its call and waits for the next attempt (_rank/abandon.py).
ABANDON_SIGNAL = signal.SIGRTMIN + 5
# Sent by a rank to its own main thread alone, to end a blocking call (a sleep, a wait for a batch)
# there, so that the exception ABANDON_SIGNAL asks for is raised at once (_rank/abandon.py).
ABANDON_WAKE_SIGNAL = signal.SIGRTMIN + 6


def panel_metrics_name(rank: int) -> str:
    """The metric points the rank logged, one "key<TAB>step<TAB>value" line each, for the caller's
    live panel; written by the rank only where ENV_PANEL_METRICS is set."""
    return f"rank_{rank}.metrics.tsv"


def progress_name(rank: int) -> str:
    """The rank's progress, PROGRESS_SIZE bytes in PROGRESS_FORMAT, which the rank keeps mapped and
    rewrites in place as it steps, fetches batches and enters collectives (progress.py); read by
    the caller's stall watch (_launch/stall_watch.py)."""
    return f"rank_{rank}.progress"


def forensics_stacks_name(rank: int) -> str:
    """Where the rank's faulthandler writes every thread's stack on FORENSICS_SIGNAL: a file of
    its own, so that the stacks gathered for a stall report never reach the user's display."""
    return f"rank_{rank}.stacks"


def forensics_ask_name(rank: int) -> str:
    """A FIFO the rank's forensics thread reads: a line written there asks it for its evidence."""
    return f"rank_{rank}.ask"


def forensics_answer_name(rank: int) -> str:
    """The rank's evidence (JSON: its flight recorder's last collectives), written on each ask."""
    return f"rank_{rank}.evidence.json"


def forensics_collectives_name(rank: int) -> str:
    """The collectives the rank's flight recorder holds (JSON: time, collectives), written when a
    FORENSICS_ASK_COLLECTIVES line is read on its FIFO: the straggler watch's view of collectives
    that no Python call shows (DDP's gradient all-reduces)."""
    return f"rank_{rank}.collectives.json"


# The lines a rank's forensics thread reads on its FIFO: one asks for its evidence, one for its
# flight recorder's collectives alone, one ends the thread.
FORENSICS_ASK_EVIDENCE = b"ask\n"
FORENSICS_ASK_COLLECTIVES = b"collectives\n"
FORENSICS_ASK_STOP = b"stop\n"


# A rank's progress record, little-endian: magic, state, pid, optimizer steps, DataLoader
# batches, collectives entered through torch.distributed's Python functions, the time (time.time())
# the state began, the last sign of progress, the last step's end, the last step's length and
# the seconds of it spent waiting for data and in collectives, the same two summed over the
# call; then the call's marks for its goodput ledger (_launch/goodput.py): when the function
# began, when torch's import ended where the function imported it, when it was ready (its first collective or step ended) and the data wait summed by
# then, when it returned or raised, the seconds its saves of torch.distributed.checkpoint held
# the training thread, the steps done when the last completed save began and how many saves
# completed; and the name of the current (or last) collective. A new layout takes a new magic.
PROGRESS_FORMAT = "<8sIIqqqdddddddddddddddqq24s"
PROGRESS_MAGIC = b"fanrunP2"
PROGRESS_FIELDS = ("magic", "state", "pid", "steps", "batches", "collectives", "state_since", "progress_at",
                   "step_at", "step_s", "step_data_s", "step_comm_s", "data_s", "comm_s", "began_at", "torch_at", "ready_at",
                   "ready_data_s", "ended_at", "failed_at", "checkpoint_s", "checkpoint_step", "checkpoints", "op")
# What the rank is doing, the record's "state".
STATE_COMPUTE = 0  # anything but the two below: its own code
STATE_DATA = 1  # in a DataLoader's __next__
STATE_COLLECTIVE = 2  # in a collective of torch.distributed (op, the `collectives`-th)


# A stall's report (_launch/stall_outcome.py), as JSON and as text: the last one of the attempt,
# written by the caller; tracking uploads them with the logs.
STALL_REPORT_JSON = "stall-report.json"
STALL_REPORT_TEXT = "stall-report.txt"


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
ENV_PROGRESS = "FANRUN_PROGRESS"  # "1": the rank keeps its progress record and answers forensics (progress.py)
ENV_KEEP_ALIVE = "FANRUN_KEEP_ALIVE"  # "1": a spare rank that ends its call well stays for the next (CONTROL_KEPT)
# "1": a spare rank whose attempt fails (its own failure or another rank's, ABANDON_SIGNAL) stays
# for the next attempt, unless its process is no longer fit for one (_rank/abandon.py)
ENV_KEEP_SURVIVORS = "FANRUN_KEEP_SURVIVORS"

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
# To a spare zygote (_rank/zygote.py), which says SPARE_READY once its imports are done: fork a
# spare. This word, the path of fanrun-keeper and a newline, with two descriptors attached
# (SCM_RIGHTS): the forked keeper's channel and the spare's control channel. It answers the
# keeper's pid in decimal and a newline.
ZYGOTE_FORK = "fork "
# From a rank that was a spare, after CONTROL_DONE: "my output is flushed, my stdout and stderr
# are no longer the call's, and I wait on my control channel for another call".
CONTROL_KEPT = "kept"

# A rank's output streams, numbered as their descriptors: the engine reports each piece of
# output with one of them (fanrun._core.Stream, whose STDOUT and STDERR equal these).
STDOUT = 1
STDERR = 2
