"""fanrun.ray_init and fanrun.ray_shutdown: this process's connection to a Ray cluster, which
@distributed(nodes=...) places its ranks on. Ray is imported here, when one is called, never by
`import fanrun`."""

from __future__ import annotations

import os
import sys

INSTALL_HINT = "fanrun's Ray backend needs Ray on the caller and on every node: pip install 'fanrun[ray]'"

# What ray_init did in this process: the address it was given (or found in RAY_ADDRESS), and
# the RAY_ADDRESS it replaced (None where there was none), which ray_shutdown puts back.
_state: dict = {}


def import_ray():
    """Ray, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return ray


def is_connected() -> bool:
    """Whether this process is connected to a Ray cluster, found without importing Ray."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def ray_init(address: str | None = None, **ray_init_kwargs) -> str:
    """Connects this process to the Ray cluster at `address`, or at $RAY_ADDRESS where set;
    otherwise starts a Ray head on this machine, which owns its GPUs. Returns the cluster's
    address and sets RAY_ADDRESS to it for this process (and what it starts).

    Calling it again while connected returns the same address; `ray_init_kwargs` go to
    ray.init (for example `num_cpus=`, `runtime_env=`)."""
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise ValueError(f"address must be a Ray cluster's address such as 'ray://host:10001' or 'host:6379', not {address!r}")
    ray = import_ray()
    if ray.is_initialized():
        current = _address(ray, asked=_state.get("asked"))
        if address is not None and address not in (current, "auto", _state.get("asked")):
            raise RuntimeError(
                f"this process is connected to the Ray cluster at {current} already; call fanrun.ray_shutdown() "
                f"before connecting to {address}"
            )
        return current
    target = address or os.environ.get("RAY_ADDRESS") or None
    ray.init(address=target, **ray_init_kwargs)
    current = _address(ray, asked=target)
    _state.update(asked=target, replaced=os.environ.get("RAY_ADDRESS"))
    os.environ["RAY_ADDRESS"] = current
    return current


def ray_shutdown() -> None:
    """Disconnects from the cluster that ray_init connected to, and stops it if ray_init started
    it; RAY_ADDRESS is put back as it was. Does nothing when not connected."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    if _state:
        replaced = _state.get("replaced")
        if replaced is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = replaced
        _state.clear()


def _address(ray, asked: str | None) -> str:
    """The cluster's own address; through Ray Client (ray://), which hides it, the one asked for."""
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:
        if asked:
            return asked
        raise
