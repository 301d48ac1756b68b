"""The GPU cards ``flash validate`` checks a placement against (``resources.card``,
``resources.gpu_memory_gib``): known by name, or by their memory; read by ``flash.app.config_checks``
(an unknown name is refused at load) and ``flash.app.memory_fit`` (the fit)."""

from __future__ import annotations

from dataclasses import dataclass

from flash.errors import ConfigError

GIB = 2**30
# Cards known by name: memory as torch reports it (``total_memory``), in GiB.
CARDS = {"H100": 79.6, "H200": 139.8}


@dataclass(frozen=True)
class Card:
    name: str
    bytes: int


def resolve_card(card: str, gpu_memory_gib: float) -> Card | None:
    """The card the placement is checked against: ``gpu_memory_gib`` when set (named ``card`` if
    given), else a name from ``CARDS`` (any case); None when neither is set. An unknown name is a
    ``ConfigError`` naming the known ones and the other setting."""
    if gpu_memory_gib < 0:
        raise ConfigError(f"resources.gpu_memory_gib must be >= 0 (0: the card's), got {gpu_memory_gib}")
    if gpu_memory_gib > 0:
        return Card(card or f"{gpu_memory_gib:g} GiB card", int(gpu_memory_gib * GIB))
    if not card:
        return None
    known = {name.lower(): name for name in CARDS}
    if card.lower() not in known:
        raise ConfigError(
            f"resources.card={card} is not a card flash knows ({', '.join(CARDS)}): set "
            f"resources.gpu_memory_gib to its memory in GiB instead"
        )
    name = known[card.lower()]
    return Card(name, int(CARDS[name] * GIB))
