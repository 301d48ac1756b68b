"""Errors a user sees as one clear message (the CLI prints them without a traceback)."""


class FlashError(Exception):
    """Base of every error the CLI reports as ``error: <message>`` with a non-zero exit."""


class ConfigError(FlashError):
    """A recipe or override that cannot run: unknown key, bad value, unknown plugin name."""


class RecipeNotFound(FlashError):
    """RECIPE is neither a name from `flash ls` nor a readable path."""
