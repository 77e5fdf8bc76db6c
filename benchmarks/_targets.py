"""A benchmark's targets: every verdict printed as "met" or "NOT met", and the exit code they give the script.

A figure that misses its target is reported as not met, whatever the reason (the machine's noise, a
saturated emulation, a known limit): the words beside the verdict say why, the verdict does not soften.
A script that printed a "NOT met" exits 1.
"""

from __future__ import annotations

MET, NOT_MET = "met", "NOT met"


def verdict(met: bool) -> str:
    """``"met"`` or ``"NOT met"``."""
    return MET if met else NOT_MET


def at_most(value: float | None, bound: float) -> str:
    """The verdict of a target ``value <= bound`` (a missing or NaN value is not met)."""
    return verdict(value is not None and value == value and value <= bound)


def at_least(value: float | None, bound: float) -> str:
    """The verdict of a target ``value >= bound`` (a missing or NaN value is not met)."""
    return verdict(value is not None and value == value and value >= bound)


class Verdicts:
    """The verdicts one invocation printed, and the exit code they make.

    Attributes:
        missed: What was not met, in words, in the order judged.
    """

    def __init__(self) -> None:
        self.missed: list[str] = []

    def note(self, what: str, said: str) -> str:
        """Record the verdict ``said`` (from :func:`verdict`, :func:`at_most` or :func:`at_least`) of ``what``.

        Returns:
            ``said``, to print.
        """
        if said != MET:
            self.missed.append(what)
        return said

    def exit_code(self) -> int:
        """1 when a target was not met, else 0."""
        return 1 if self.missed else 0
