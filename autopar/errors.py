"""The exceptions autopar raises: one clear message each, saying what went wrong and
what to try. Every one derives from :class:`AutoparError`, so a caller can catch all."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class CaptureError(AutoparError):
    """The model could not be captured as a graph (names the module or op, and why)."""


class UnsupportedOpError(AutoparError):
    """An operator has no sharding rule, so no plan can place it."""


class ConfigError(AutoparError, ValueError):
    """An argument is invalid: an unknown GPU, a degree that does not divide, ..."""


class FactoryError(ConfigError):
    """A user's model factory (``path/to/file.py:factory``) raised when called."""


class NoFeasiblePlanError(AutoparError):
    """No plan fits in the memory budget (says the least memory any plan needs)."""


class PlanFormatError(AutoparError, ValueError):
    """A plan or profile file is malformed, of an unknown version, or for another model."""


class LoweringError(AutoparError):
    """A plan cannot be applied to the live model."""


class CheckpointError(AutoparError, ValueError):
    """A checkpoint cannot be saved or loaded: missing, half written, damaged, or of
    another model."""


class RankError(AutoparError):
    """A rank of a distributed job raised an exception that cannot travel to the other
    ranks as it is (it does not survive pickling), or a rank stopped answering. Names
    the rank and, for the first, what it raised; raised on every rank alike."""
