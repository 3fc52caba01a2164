"""The one error a plugin can cause: :class:`PluginError`, whose message names the plugin.

This module imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class PluginError(Exception):
    """A plugin could not be loaded, configured or run; the message names the plugin.

    Attributes:
        plugin: The plugin's registered name, when one is known.
    """

    def __init__(self, message: str, *, plugin: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin


@contextmanager
def failures_named(what: str, plugin: str | None = None) -> Iterator[None]:
    """Run plugin code: an exception becomes ``PluginError("<what>: <Type>: <message>")``,
    chained to it; a :class:`PluginError` passes as it is."""
    try:
        yield
    except PluginError:
        raise
    except Exception as exc:
        raise PluginError(f"{what}: {type(exc).__name__}: {exc}", plugin=plugin) from exc
