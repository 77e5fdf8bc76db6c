"""The warm pool's settings and errors (a leaf module: the launcher imports it without the pool)."""

from __future__ import annotations

from dataclasses import dataclass

from unicron_elastic.api import ConfigError, UnicronError

#: ``--preload``'s default: the installed packages the training script imports at module level (torch, ...).
AUTO = "auto"
#: ``--preload`` (or ``UNICRON_PRELOAD``) that turns the pool off, as ``--no-preload`` does.
OFF = "none"
#: ``--spares``' default: one worker forked ahead of need.
DEFAULT_SPARES = 1
#: Seconds the first worker waits for the zygote's imports before the pool gives up (plain subprocesses).
DEFAULT_READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class WarmConfig:
    """How the agent starts its workers.

    Attributes:
        preload: Modules the zygote imports (``("auto",)``: the installed packages the script imports;
            empty: no pool, every worker a plain subprocess as torchrun starts it).
        spares: Workers forked ahead of need, each ready to become the next worker at once.
        ready_timeout: Seconds to wait for the zygote's imports before falling back.

    Raises:
        ConfigError: ``spares`` is negative or ``ready_timeout`` not positive.
    """

    preload: tuple[str, ...] = (AUTO,)
    spares: int = DEFAULT_SPARES
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S

    def __post_init__(self) -> None:
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) or self.spares < 0:
            raise ConfigError(f"--spares {self.spares!r}: a whole number >= 0")
        if not self.ready_timeout > 0:
            raise ConfigError(f"ready_timeout {self.ready_timeout!r}: seconds > 0")

    @property
    def enabled(self) -> bool:
        """Whether workers are forked from a zygote at all."""
        return bool(self.preload)

    @classmethod
    def from_flag(cls, preload: str | None, spares: int = DEFAULT_SPARES) -> WarmConfig:
        """The settings of ``--preload MODULE[,MODULE...]`` (``auto``; ``none``: off) and ``--spares``.

        Raises:
            ConfigError: A module name is not a dotted Python name, or ``--spares`` is negative.
        """
        text = (preload if preload is not None else AUTO).strip()
        if text.lower() in (OFF, "off", "0", "false", ""):
            return cls(preload=(), spares=spares)
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        bad = [n for n in names if n != AUTO and not all(part.isidentifier() for part in n.split("."))]
        if bad:
            raise ConfigError(f"--preload {text!r}: {', '.join(bad)} is not a module name (MODULE[,MODULE...], "
                              f"'{AUTO}' or '{OFF}')")
        return cls(preload=names, spares=spares)


class WarmPoolError(UnicronError):
    """The zygote or a spare broke the pool's protocol (the pool then starts plain subprocesses)."""
