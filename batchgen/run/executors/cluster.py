"""Ray itself: importing it (an extra), checking a cluster's address, and keeping the caller's
signal handlers across ``ray.init``. The only module that imports ``ray``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

from batchgen.config import ConfigError, ConfigIssue, ExecutorSection

__all__ = ["RAY_INSTALL_HINT", "caller_signal_handlers", "check_address", "import_ray", "ray_location"]

RAY_INSTALL_HINT = 'pip install "batchgen[ray]"'


def import_ray() -> Any:
    """``import ray``, or :class:`ConfigError` naming the extra to install."""
    try:
        # deferred: Ray (~2 s, an extra) only when a Ray run asks for it
        import ray
    except ImportError as exc:
        raise ConfigError([ConfigIssue(
            "executor.backend",
            f"backend 'ray' needs Ray, which is not installed ({exc}); install it with: {RAY_INSTALL_HINT}",
        )]) from None
    return ray


def _host_port(address: str) -> tuple[str, int] | None:
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    return (host, int(port)) if sep and port.isdigit() else None


def check_address(section: ExecutorSection, timeout: float = 5.0) -> str | None:
    """``batchgen validate``: connect to ``section.address`` and disconnect.

    Returns a one-line description of the cluster, or None when there is nothing to check
    (local backend, or ``address: null``, which starts a local Ray at run time).

    Raises:
        ConfigError: on ``executor.address``, saying what failed and how to start a cluster.
    """
    if section.backend != "ray" or section.address is None:
        return None
    ray = import_ray()
    address = section.address

    def fail(why: str) -> ConfigError:
        return ConfigError([ConfigIssue(
            "executor.address",
            f"cannot reach the Ray cluster at {address!r}: {why}; start one with 'ray start --head' "
            "(then 'ray start --address=HEAD:6379' on the other machines), or set executor.address: null "
            "to start a local Ray",
        )])

    target = _host_port(address)
    if target is not None:
        try:
            socket.create_connection(target, timeout=timeout).close()
        except OSError as exc:
            raise fail(f"{target[0]}:{target[1]} does not answer ({exc.strerror or exc})") from None
    if ray.is_initialized():  # this process is already connected (a library user, the tests)
        return f"already connected to {ray.get_runtime_context().gcs_address}"
    found: dict[str, Any] = {}

    def connect() -> None:
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
            try:
                found["resources"] = ray.cluster_resources()
            finally:
                ray.shutdown()
        except Exception as exc:  # noqa: BLE001 - any failure to connect is the user's to fix
            found["error"] = exc

    # Ray's own connection timeouts run to minutes (and some networks accept any TCP connection),
    # so the connection gets its own deadline.
    thread = threading.Thread(target=connect, name="ray-address-check", daemon=True)
    thread.start()
    thread.join(timeout * 4)
    if thread.is_alive():
        raise fail(f"no answer within {timeout * 4:.0f} s")
    if "error" in found:
        exc = found["error"]
        raise fail(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
    resources = found["resources"]
    gpus = int(resources.get("GPU", 0))
    return f"Ray cluster at {address}: {int(resources.get('CPU', 0))} CPUs, {gpus} GPUs"


@contextlib.contextmanager
def caller_signal_handlers() -> Iterator[None]:
    """Keep the process's own SIGINT and SIGTERM handlers across ``ray.init``.

    ``ray.init`` installs a SIGTERM handler that exits at once (with a local Ray it first kills
    Ray's processes), which would skip the run's clean stop: summary, lock, exit status 143 (see
    ``batchgen.cli``). A handler the caller installed is put back; a caller that left the
    default keeps Ray's. The clean stop ends the replicas itself (:meth:`RayExecutor.close`).
    """
    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            if handler not in (signal.SIG_DFL, None) and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


def ray_location() -> tuple[str | None, list[str]]:
    """This actor's Ray node id and GPU ids (``(None, [])`` outside Ray)."""
    try:
        # deferred: Ray (~2 s, an extra) only when a Ray run asks for it
        import ray

        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # noqa: BLE001 - informational only
        return None, []
