"""The one error a plugin can cause: :class:`PluginError`, whose message names the plugin.

This module imports nothing heavy.
"""

from __future__ import annotations


class PluginError(Exception):
    """A plugin could not be loaded, configured or run; the message names the plugin.

    Attributes:
        plugin: The plugin's registered name, when one is known.
    """

    def __init__(self, message: str, *, plugin: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin
