"""TorchDistributor with the constructor and run() of pyspark.ml.torch.distributor, on
fanrun's engine: code written for Spark's launcher runs unchanged on this machine, without Spark.

As Spark's, it makes no MLflow run of its own: the processes get the caller's environment, and
what a train function logs with mlflow goes where the user's MLflow configuration says (on
Databricks, a function calls mlflow.start_run() itself)."""

from __future__ import annotations

import numbers
import os
import warnings
from typing import Any, Callable

from . import _accelerators
from ._caller_frames import raised_from_the_caller
from ._decorator import DistributedFunction
from ._launch import call
from ._spec.program import RankProgram
from ._spec.spec import DEFAULT_TIMEOUT_S, Options


class TorchDistributor:
    """`TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(train_fn, *args)`
    runs `train_fn` on that many ranks and returns rank 0's result, as Spark's does; `run`
    also takes the path of a `.py` file, whose arguments are passed as strings."""

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True, _ssl_conf: Any = None) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, numbers.Integral):
            raise TypeError(f"num_processes must be an int, not {type(num_processes).__name__}")
        if num_processes < 1:
            raise ValueError(f"num_processes must be at least 1, not {num_processes}")
        for name, value in (("local_mode", local_mode), ("use_gpu", use_gpu)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, not {value!r}")
        if not local_mode:
            # Spark would spread the processes over its executors; there is one machine here.
            warnings.warn(
                "local_mode=False spreads processes over a Spark cluster; fanrun runs them all on this machine",
                UserWarning,
                stacklevel=2,
            )
        self.num_processes = int(num_processes)
        self.local_mode = local_mode
        self.use_gpu = use_gpu

    @raised_from_the_caller
    def run(self, train_object: Callable | str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """Rank 0's return value for a function; None for a file."""
        return self._run(train_object, args, kwargs)

    def _run(self, train_object: Callable | str | os.PathLike, args: tuple, kwargs: dict) -> Any:
        if isinstance(train_object, (str, os.PathLike)):
            path = os.fspath(train_object)
            if kwargs:
                raise TypeError("a .py file takes its arguments as strings in *args, not keyword arguments")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"train_object {path!r} is neither a function nor an existing file")
            call.run(call.plan(os.path.basename(path), self._options(), RankProgram.script(path, [str(a) for a in args])))
            return None
        if not callable(train_object):
            raise TypeError(f"train_object must be a function or the path of a .py file, not {type(train_object).__name__}")
        return DistributedFunction(train_object, self._options()).distributed(*args, **kwargs)[0]

    def _options(self) -> Options:
        """As Spark's: use_gpu=True takes one GPU per process, and without them is an error; the
        ranks' MLflow is the caller's, untouched."""
        accelerator = None if self.use_gpu else _accelerators.parse_accelerator_type("CPU")
        required = ("use_gpu=True", "pass use_gpu=False") if self.use_gpu else None
        return Options(num_accelerators=self.num_processes, accelerator=accelerator, timeout=DEFAULT_TIMEOUT_S,
                       gpus_required=required, leave_mlflow_alone=True)
