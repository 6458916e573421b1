"""The decorator's arguments: names kept from databricks.air and serverless_gpu, and every bad input."""

from __future__ import annotations

import re
import warnings

import pytest

import fanrun
from fanrun import AcceleratorType, GPUType, distributed
from fanrun._accelerators import Gpu, Inventory, parse_accelerator_type, plan_run


def identity(x):
    return x


def machine(count: int, name: str = "NVIDIA H200") -> Inventory:
    gpus = tuple(Gpu(i, name, f"GPU-{i}", 141 << 30) for i in range(count))
    return Inventory(gpus, gpus, "")


NO_GPU = Inventory((), (), "libnvidia-ml.so.1 could not be loaded")


def test_bare_and_called_forms_both_decorate():
    bare = distributed(identity)
    called = distributed()(identity)
    assert isinstance(bare, fanrun.DistributedFunction)
    assert isinstance(called, fanrun.DistributedFunction)
    assert bare.__name__ == "identity"


def test_direct_call_runs_in_process():
    @distributed()
    def add(a, b):
        return a + b

    assert add(2, 3) == 5


@pytest.mark.parametrize("bad", [0, -1])
def test_num_accelerators_below_one_names_the_machine(bad):
    with pytest.raises(ValueError, match=rf"at least 1, not {bad}; this machine has"):
        distributed(num_accelerators=bad)


@pytest.mark.parametrize("bad", [1.5, "2", True])
def test_num_accelerators_must_be_an_int(bad):
    with pytest.raises(TypeError, match="num_accelerators must be an int"):
        distributed(num_accelerators=bad)


def test_more_gpus_than_the_machine_has():
    with pytest.raises(fanrun.AcceleratorMismatchError, match=r"num_accelerators=4, but this machine has 2 GPUs visible \(2 x NVIDIA H200\)"):
        plan_run(4, None, machine(2))


def test_default_uses_every_gpu():
    plan = plan_run(None, None, machine(8, "NVIDIA H100 80GB HBM3"))
    assert (plan.world_size, plan.use_gpus, plan.accelerator_type) == (8, True, "GPU_8xH100")


def test_no_gpu_runs_cpu_processes():
    plan = plan_run(None, None, NO_GPU)
    assert (plan.world_size, plan.use_gpus) == (fanrun.DEFAULT_CPU_RANKS, False)
    assert plan_run(5, None, NO_GPU).world_size == 5


@pytest.mark.parametrize("value", ["GPU_8xH100", AcceleratorType.GPU_8xH100, " GPU_8xH100 "])
def test_matching_type_is_accepted(value):
    plan = plan_run(None, parse_accelerator_type(value), machine(8, "NVIDIA H100 80GB HBM3"))
    assert plan.world_size == 8


def test_a10_matches_an_a10g_but_not_an_a100():
    assert plan_run(None, parse_accelerator_type("GPU_1xA10"), machine(1, "NVIDIA A10G")).use_gpus
    with pytest.raises(fanrun.AcceleratorMismatchError, match=r"'GPU_1xA10' does not match this machine, which has 1 x NVIDIA A100-SXM4-80GB"):
        plan_run(None, parse_accelerator_type("GPU_1xA10"), machine(1, "NVIDIA A100-SXM4-80GB"))


def test_type_mismatch_names_both():
    with pytest.raises(fanrun.AcceleratorMismatchError, match=r"'GPU_8xH100' does not match this machine, which has 2 x NVIDIA H200; use 'GPU_2xH200'"):
        plan_run(None, parse_accelerator_type("GPU_8xH100"), machine(2))


def test_gpu_type_on_a_machine_without_gpu():
    with pytest.raises(fanrun.AcceleratorMismatchError, match="asks for GPUs, but this machine has no GPU"):
        plan_run(None, parse_accelerator_type("GPU_1xH100"), NO_GPU)


def test_gpu_type_without_gpu_fails_before_any_process_starts(runs_dir):
    before = set(runs_dir.iterdir())

    @distributed(accelerator_type="GPU_1xH100")
    def never():
        raise AssertionError("must not run")

    with pytest.raises(fanrun.AcceleratorMismatchError):
        never.distributed()
    assert set(runs_dir.iterdir()) == before


def test_cpu_type_runs_cpu_processes_on_a_gpu_machine():
    plan = plan_run(3, parse_accelerator_type(AcceleratorType.CPU), machine(2))
    assert (plan.world_size, plan.use_gpus, plan.accelerator_type) == (3, False, "CPU")


@pytest.mark.parametrize("bad", ["H200x8", "GPU_8H100", "GPU_0xH100", "TPU"])
def test_unknown_type_strings(bad):
    with pytest.raises(ValueError, match="accelerator_type"):
        parse_accelerator_type(bad)


def test_type_of_wrong_kind():
    with pytest.raises(TypeError, match="accelerator_type must be a string"):
        distributed(accelerator_type=8)


@pytest.mark.parametrize("legacy", ["A10", "h100", "B300", GPUType.H100])
def test_legacy_type_values_warn_and_work(legacy):
    with pytest.warns(FutureWarning, match="legacy name from serverless_gpu"):
        request = parse_accelerator_type(legacy)
    assert request.model == str(legacy).upper()
    assert request.count is None


def test_legacy_argument_names_warn_and_work():
    with pytest.warns(FutureWarning, match="gpus= is a legacy name"):
        decorated = distributed(gpus=2)(identity)
    assert decorated._options.num_accelerators == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decorated = distributed(gpu_type="H100")(identity)
    assert [w.category for w in caught] == [FutureWarning, FutureWarning]
    assert decorated._options.accelerator.model == "H100"


def test_old_and_new_name_together_is_a_type_error():
    with pytest.raises(TypeError, match="num_accelerators or its legacy name gpus, not both"):
        distributed(num_accelerators=2, gpus=2)
    with pytest.raises(TypeError, match="accelerator_type or its legacy name gpu_type, not both"):
        distributed(accelerator_type="GPU_1xH100", gpu_type="H100")


@pytest.mark.parametrize("bad", [0, -5, float("nan")])
def test_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match="timeout must be positive"):
        distributed(timeout=bad)


def test_timeout_type_and_none():
    with pytest.raises(TypeError, match="timeout must be a number"):
        distributed(timeout="10")
    assert distributed(timeout=None)(identity)._options.timeout is None
    assert distributed()(identity)._options.timeout == 3 * 60 * 60


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"display": "fancy"}, "display must be 'panel', 'logs', 'quiet' or None (the panel in a notebook, logs "
                               "elsewhere), not 'fancy'"),
        ({"stall_warning": 0}, "stall_warning must be a positive number of seconds, or None to never flag a quiet "
                               "rank, not 0"),
        ({"stall_warning": True}, "stall_warning must be a positive number of seconds"),
        ({"stall_warning": float("inf")}, "stall_warning must be a positive number of seconds"),
        ({"stall_warning": "30"}, "stall_warning must be a positive number of seconds"),
    ],
)
def test_bad_display_arguments_are_errors_at_decoration(options, says):
    """The same check as fanrun run's --display and --stall-warning (test_cli.py), in the decorator's words."""
    with pytest.raises(ValueError, match=re.escape(says)):
        distributed(**options)
    shown = distributed(display="quiet", stall_warning=None)(identity)._options
    assert (shown.display, shown.stall_warning) == ("quiet", None)


def test_decorating_a_non_callable():
    with pytest.raises(TypeError, match="decorates a function"):
        distributed()(42)


def test_remote_false_is_accepted_and_remote_true_explained():
    assert isinstance(distributed(remote=False)(identity), fanrun.DistributedFunction)
    with pytest.raises(ValueError, match="remote=True runs on Databricks' managed GPU pool"):
        distributed(remote=True)
    with pytest.raises(TypeError, match="remote must be True or False"):
        distributed(remote="yes")


# ---------------------------------------------------------------- nodes, backend (tests/ray/ runs them on a cluster)


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [
        ({"nodes": 0}, ValueError, "nodes must be at least 1"),
        ({"nodes": 1.5}, TypeError, "nodes must be an int"),
        ({"nodes": True}, TypeError, "nodes must be an int"),
        ({"nodes": 2, "num_accelerators": 3}, ValueError, "ask for a multiple of 2"),
        ({"backend": "kubernetes"}, ValueError, "backend must be None, 'local', 'ray' or 'slurm'"),
        ({"backend": "ray", "slurm": {"partition": "gpu"}}, ValueError, "slurm= gives srun's options"),
        ({"slurm": {"ntasks": 4}}, ValueError, "fanrun sets --ntasks itself"),
        ({"slurm": {"partitoin": "gpu"}}, ValueError, "is not one of the srun options fanrun passes on"),
        ({"slurm": ["gpu"]}, TypeError, "slurm must be a dict of srun's options"),
        ({"backend": "local", "nodes": 2}, ValueError, "backend='local' runs on this machine only"),
        ({"nodes": 2, "placement_timeout": 0}, ValueError, "placement_timeout must be a positive number"),
    ],
)
def test_bad_cluster_arguments_are_errors_at_decoration(options, error, says):
    with pytest.raises(error, match=says):
        distributed(**options)


def test_nodes_without_a_ray_connection_says_to_connect_before_anything_starts(runs_dir):
    before = set(runs_dir.iterdir())
    with pytest.raises(ValueError, match=r"call fanrun.ray_init\(\) first"):
        distributed(num_accelerators=4, nodes=2)(lambda: 1).distributed()
    assert set(runs_dir.iterdir()) == before


def test_one_node_without_ray_runs_here():
    assert distributed(num_accelerators=2, nodes=1, accelerator_type="CPU", tracking=False)(lambda: 5).distributed() == [5, 5]


def test_import_fanrun_and_its_decorator_load_no_ray():
    import subprocess
    import sys

    code = "import sys, fanrun; fanrun.distributed; fanrun.ray_init; import fanrun.backends.ray; print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_ray_init_without_ray_installed_says_how_to_install_it():
    import subprocess
    import sys

    code = ("import sys; sys.modules['ray'] = None\nimport fanrun\n"
            "try:\n    fanrun.ray_init()\nexcept ImportError as error:\n    print(error)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'fanrun[ray]'" in done.stdout, done.stderr


# ---------------------------------------------------------------- the package's namespace, the call's arguments


def test_the_namespace_is_the_public_api_and_nothing_else():
    import fanrun._decorator  # noqa: F401 (the call machinery, and the subpackages it loads)

    assert {name for name in dir(fanrun) if not name.startswith("_")} == set(fanrun.__all__)
    assert {"importlib", "TYPE_CHECKING"}.isdisjoint(vars(fanrun))
    for name in fanrun.__all__:
        assert getattr(fanrun, name) is not None, name


def test_arguments_that_do_not_fit_the_signature_are_a_type_error_before_any_rank_starts(runs_dir):
    @distributed(num_accelerators=2, tracking=False)
    def train(epochs, batch_size=32):
        raise AssertionError("must not run")

    before = set(runs_dir.iterdir())
    for args, kwargs, says in [((), {}, "missing a required argument: 'epochs'"),
                               ((1, 2, 3), {}, "too many positional arguments"),
                               ((1,), {"epoch": 3}, "got an unexpected keyword argument 'epoch'")]:
        with pytest.raises(fanrun.CallArgumentsError, match=r"train\(epochs, batch_size=32\) cannot take the arguments given to "
                                            rf"\.distributed\(\): {says}\. No rank was started"):
            train.distributed(*args, **kwargs)
    assert set(runs_dir.iterdir()) == before
    assert issubclass(fanrun.CallArgumentsError, TypeError)


# ---------------------------------------------------------------- gpus= asks for GPUs; CPU ranks and cores


def test_gpus_asks_for_gpus_and_without_them_is_an_error():
    with pytest.raises(fanrun.AcceleratorMismatchError, match=r"gpus=8 asks for GPUs, but this machine has no GPU "
                                                              r"\(.*\); to run CPU processes here, pass num_accelerators=8"):
        plan_run(8, None, NO_GPU, gpus_required=("gpus=8", "pass num_accelerators=8 instead"))
    assert plan_run(2, None, machine(2), gpus_required=("gpus=2", "pass num_accelerators=2 instead")).use_gpus


@pytest.mark.skipif(fanrun._accelerators.detect().visible, reason="needs a machine without a GPU")
def test_gpus_on_a_machine_without_gpu_fails_before_any_process_starts(runs_dir):
    before = set(runs_dir.iterdir())
    with pytest.warns(FutureWarning, match="gpus= is a legacy name"):
        decorated = distributed(gpus=8, tracking=False)(identity)
    with pytest.raises(fanrun.AcceleratorMismatchError, match="gpus=8 asks for GPUs"):
        decorated.distributed(1)
    assert set(runs_dir.iterdir()) == before


def test_a_gpu_type_where_every_gpu_is_hidden_is_an_error():
    hidden = Inventory((), machine(2).machine, "CUDA_VISIBLE_DEVICES='' hides all 2 GPUs")
    with pytest.raises(fanrun.AcceleratorMismatchError, match=r"'GPU_2xH200' asks for GPUs, but this process sees no "
                                                              r"GPU \(CUDA_VISIBLE_DEVICES='' hides all 2 GPUs\)"):
        plan_run(None, parse_accelerator_type("GPU_2xH200"), hidden)


def test_the_no_gpu_notice_is_for_a_defaulted_count_only():
    assert plan_run(None, None, NO_GPU).notice.startswith("no GPU found: 2 CPU processes; use the gloo backend")
    assert plan_run(2, None, NO_GPU).notice == ""
    assert plan_run(None, parse_accelerator_type("CPU"), NO_GPU).notice == ""


def test_more_cpu_ranks_than_cores_is_a_warning():
    import os

    cores = len(os.sched_getaffinity(0))
    plan = plan_run(cores + 1, None, NO_GPU)
    assert plan.warning.startswith(f"{cores + 1} CPU processes share the {cores} core")
    assert plan.warning.endswith(f"ask for at most {cores}")
    assert plan_run(cores, None, NO_GPU).warning == ""


def test_the_signature_in_engine_md_is_the_decorators():
    import ast
    import inspect
    import re
    from pathlib import Path

    from fanrun._decorator import _UNSET

    page = (Path(__file__).parent.parent / "docs" / "engine.md").read_text()
    block = re.search(r"## The decorator\n.*?```python\n(def distributed\(.*?\): \.\.\.)\n```", page, re.DOTALL)
    assert block, "docs/engine.md has no signature block under '## The decorator'"
    documented = ast.parse(block.group(1)).body[0].args
    defaults = [None] * (len(documented.args) - len(documented.defaults)) + documented.defaults
    written = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, ast.literal_eval(d)) for a, d in zip(documented.args, defaults)]
    written += [(a.arg, inspect.Parameter.KEYWORD_ONLY, ast.literal_eval(d)) for a, d in zip(documented.kwonlyargs, documented.kw_defaults)]
    actual = [(p.name, p.kind, ... if p.default is _UNSET else p.default)
              for p in inspect.signature(distributed).parameters.values()]
    assert written == actual
    # Each argument has its row in the table below it.
    table = page[block.end():page.index("\n## ", block.end())]
    rows = {name for row in re.findall(r"^\| (.*?) \|", table, re.MULTILINE) for name in re.findall(r"`(\w+)`", row)}
    assert {name for name, _, _ in actual} <= rows, {name for name, _, _ in actual} - rows
