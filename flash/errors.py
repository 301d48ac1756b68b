"""Errors a user sees as one clear message (the CLI prints them without a traceback)."""


class FlashError(Exception):
    """Base of every error the CLI reports as ``error: <message>`` with a non-zero exit."""


class ConfigError(FlashError):
    """A recipe or override that cannot run: unknown key, bad value, unknown plugin name."""


def require(ok: bool, msg: str) -> None:
    """A config check in one line: ``ConfigError(msg)`` unless ``ok``."""
    if not ok:
        raise ConfigError(msg)


class RewardsFailing(FlashError):
    """A reward that fails on every response it is given (``reward.max_consecutive_errors`` in a
    row in training, every one of the warm start's held-out responses): the run stops, naming it."""


class RecipeNotFound(FlashError):
    """RECIPE is neither a name from `flash ls` nor a readable path."""


class RolesNotReady(FlashError):
    """A role (engine, trainer, critic, reference) that did not answer within
    ``resources.ready_timeout_s`` of being started: its model still loading or its process stuck."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as ctrl-C is: a run stops the way an interrupt does
    (roles closed, a one-line resume hint) instead of through Ray's handler (a crash dump), and a
    sweep stops its runs instead of leaving them orphaned."""


def raise_terminated(signum, frame) -> None:
    """A SIGTERM handler: raise ``Terminated`` where the main thread is."""
    raise Terminated("SIGTERM")
