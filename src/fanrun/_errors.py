"""Every exception fanrun raises: each subclasses FanrunError and the builtin it behaves like."""

from __future__ import annotations


class FanrunError(Exception):
    """Base class of fanrun's own errors."""

    def __reduce__(self):
        # Rebuilt without __init__, whose keyword-only arguments pickle could not give back: a
        # detached run's outcome carries the error its call raised to another process.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type, args: tuple, state: dict) -> FanrunError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class AcceleratorMismatchError(ValueError, FanrunError):
    """The accelerators asked for are not the ones this machine has."""


class GpuHealthError(AcceleratorMismatchError):
    """A GPU the call would use is unhealthy, or missing: found before any rank starts. `problems`
    holds one (nvml_index, uuid, reason) per unhealthy GPU (none for a missing one)."""

    def __init__(self, message: str, problems: tuple[tuple[int, str, str], ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class PayloadSerializationError(TypeError, FanrunError):
    """The function, an argument or a captured object cannot be pickled to send to the ranks."""


class CallArgumentsError(TypeError, FanrunError):
    """The arguments of a call do not fit the function's signature."""


class ResultSerializationError(TypeError, FanrunError):
    """A rank returned a value that cannot be pickled to send back."""

    def __init__(self, message: str, *, rank: int, type_name: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.type_name = type_name


class RankFailedError(RuntimeError, FanrunError):
    """A rank ended badly without an exception fanrun could re-raise: an exit code, a
    signal, sys.exit, or an exception that could not be unpickled in the caller."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        pid: int,
        exit_code: int | None = None,
        signal_name: str | None = None,
        log_path: str | None = None,
        log_tail: list[str] | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.pid = pid
        self.exit_code = exit_code
        self.signal_name = signal_name
        self.log_path = log_path
        self.log_tail = log_tail or []


class RunTimeoutError(TimeoutError, FanrunError):
    """The run outlasted its timeout. The Python stack of each rank still running was dumped
    before the kill where it could be: `stacks` holds those, `missing_stacks` says for each
    other rank why there is none."""

    def __init__(
        self,
        message: str,
        *,
        running_ranks: list[int],
        stacks: dict[int, list[str]],
        missing_stacks: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.running_ranks = running_ranks
        self.stacks = stacks
        self.missing_stacks = missing_stacks or {}


class RankStalledError(RuntimeError, FanrunError):
    """The call made no progress for its stall timeout, and on_stall="abort" stopped it: `report`
    is the stall's report (its verdict, and every rank's evidence), `culprits` the ranks it blames."""

    def __init__(self, message: str, *, report) -> None:
        super().__init__(message)
        self.report = report
        self.culprits = report.culprits


class RunNotFoundError(LookupError, FanrunError):
    """run_id= names no MLflow run in the tracking store the call logs to."""


class UnknownRunError(LookupError, FanrunError):
    """A detached run's id that names none of this user's runs."""


class RunCancelledError(FanrunError):
    """The detached run was cancelled (Run.cancel(), `fanrun cancel`) before it ended."""


class TrackingWarning(UserWarning):
    """MLflow tracking could not be done for a call; the call itself went on."""


class PayloadSizeWarning(UserWarning):
    """A call is large to send: what it carries could be read by each rank instead."""


class WorkingDirectoryError(FileNotFoundError, FanrunError):
    """The caller's working directory, where every rank starts, no longer exists."""


class DescriptorLimitError(OSError, FanrunError):
    """The caller may not open the file descriptors a run of this many ranks needs (RLIMIT_NOFILE)."""


class ClusterResourcesError(RuntimeError, FanrunError):
    """The cluster could not fit the call's ranks (nodes x accelerators) within placement_timeout."""


class NodeEnvironmentError(RuntimeError, FanrunError):
    """A cluster node cannot run the call as the caller would: different Python, torch, cloudpickle
    or fanrun versions, or no fanrun at all."""


class NodeLostError(RuntimeError, FanrunError):
    """A node of a cluster run was lost mid-call (its agent died, or the node left the cluster);
    the other nodes' ranks were stopped."""

    def __init__(self, message: str, *, node_rank: int, node_id: str, address: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.node_rank = node_rank
        self.node_id = node_id
        self.address = address
        self.ranks = ranks


class RemoteTraceback(Exception):
    """Carries a rank's traceback text; chained as the __cause__ of the re-raised exception."""

    def __str__(self) -> str:
        return self.args[0]


def raised_for_the_caller(error: BaseException) -> bool:
    """Whether fanrun raised this on purpose, for the caller: a rank's own exception, one of
    fanrun's errors, an interrupt. Its traceback through fanrun's own frames is noise; any other
    exception is a fault of fanrun's, whose frames are the story."""
    return isinstance(error, (FanrunError, KeyboardInterrupt)) or isinstance(error.__cause__, RemoteTraceback)


# Raised by the engine (fanrun._core); its one exception translator maps status codes here.
class EngineError(RuntimeError, FanrunError):
    """The engine failed in a way that is not the caller's input."""


class EngineInvalidArgument(ValueError, FanrunError):
    """The engine was asked for something it cannot do."""


class ExecutableNotFoundError(FileNotFoundError, FanrunError):
    """The program a rank should run does not exist."""


class EngineOSError(OSError, FanrunError):
    """A system call failed in the engine. Where the engine knows its errno, the error is also
    the OSError subclass Python raises for that errno (engine_os_error), with errno set."""

    def __reduce__(self):
        # The errno travels too, and with it the subclass of OSError the error was raised as.
        return _rebuild_engine_os_error, (self.errno, self.args, self.__dict__)


def engine_os_error(errnum: int, message: str) -> EngineOSError:
    """A system call of the engine's that failed with `errnum`, as fanrun._core raises it: as
    Python raises its own (a FileNotFoundError for ENOENT, a PermissionError for EACCES) with
    its errno, and as an EngineOSError, so that `except FileNotFoundError` and `except
    EngineOSError` both catch it. Its text is the engine's message alone."""
    error = _engine_os_error_type(errnum)(message)
    error.errno = errnum
    return error


# The builtin subclass of OSError that Python picks for an errno -> the EngineOSError that is one too.
_ENGINE_OS_ERRORS: dict[type[OSError], type[EngineOSError]] = {OSError: EngineOSError}


def _engine_os_error_type(errnum: int) -> type[EngineOSError]:
    builtin = type(OSError(errnum, ""))  # OSError() itself picks the subclass of an errno
    made = _ENGINE_OS_ERRORS.get(builtin)
    if made is None:
        made = _ENGINE_OS_ERRORS[builtin] = type(f"Engine{builtin.__name__}", (EngineOSError, builtin), {
            "__module__": __name__, "__doc__": f"An EngineOSError that is a {builtin.__name__} (engine_os_error)."})
    return made


def _rebuild_engine_os_error(errnum: int | None, args: tuple, state: dict) -> EngineOSError:
    cls = _engine_os_error_type(errnum) if errnum else EngineOSError
    error = cls.__new__(cls, *args)
    error.args = args
    error.errno = errnum
    error.__dict__.update(state)
    return error


class UnsafePathError(PermissionError, FanrunError):
    """A directory or file fanrun would use is not the caller's alone: another user owns it,
    others can write it (or a directory above it), or it is a symbolic link. Another user could
    plant files or links there. The message names it and says what to do."""


# Checkpoints (fanrun.data.VolumeWriter / VolumeReader).
class CheckpointCorruptError(OSError, FanrunError):
    """Checkpoint data does not match what was written: a checksum differs, a file is short
    or missing. The message names the file and the item."""


class CheckpointNotSharedError(FileNotFoundError, FanrunError):
    """A rank cannot see the directory the checkpoint's coordinator made on another machine: the
    checkpoint path is not storage that every node shares."""


class NotACheckpointError(FileNotFoundError, FanrunError):
    """The path holds no complete fanrun checkpoint."""


class CheckpointExistsError(FileExistsError, RuntimeError, FanrunError):
    """The target exists and may not be replaced: overwrite=False, or it is not a checkpoint.
    A RuntimeError too, as DCP's own writers raise for overwrite=False."""


# Datasets (fanrun.data.VolumeDataset).
class DataSourceError(FileNotFoundError, FanrunError):
    """A dataset's source does not exist or holds no file that matches its pattern."""


class DataFileError(OSError, FanrunError):
    """A file of a dataset could not be read, nor fetched, after every retry."""


class StacksError(RuntimeError, FanrunError):
    """fanrun.stacks() or `fanrun stacks` cannot reach the ranks: no such run, a run that has
    ended, one on another host, or no call running in this process."""


class TableError(ValueError, FanrunError):
    """A table cannot be read as asked: a file its log names is missing, a file is not Parquet,
    a column or a version does not exist. The message names the table and the file."""


class CacheLimitError(ValueError, FanrunError):
    """A dataset's cache_limit is smaller than what its prefetching needs."""
