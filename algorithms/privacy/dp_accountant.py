"""Epsilon spent so far: the RDP accountant of ``dp_accounting`` over the rounds' noise multipliers.

Its own module so the accounting (a library call and a list of released rounds) stays apart from
the privacy configuration and encoding in ``privacy``, which re-exports it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MEANINGFUL_EPSILON", "PrivacyAccountant", "describe_epsilon"]

MEANINGFUL_EPSILON = 10.0
"""Above this epsilon a report says the run had no meaningful privacy. At epsilon 10 an observer
may be e^10 (about 22,000) times more confident that a given site took part than before seeing
the run: the guarantee no longer bounds anything a user would care about. Deployed site-level
DP aims at single digits (the README's privacy-utility frontier shows what that costs)."""


def describe_epsilon(epsilon: float, delta: float) -> str:
    """``epsilon = E at delta = D`` for a run report, flagged when it gives no meaningful privacy,
    so a demonstration's epsilon is never read as a guarantee."""
    text = f"epsilon = {epsilon:.4g} at delta = {delta:g}"
    if epsilon > MEANINGFUL_EPSILON:
        text += f" (no meaningful privacy: epsilon > {MEANINGFUL_EPSILON:g})"
    return text


class PrivacyAccountant:
    """Epsilon at ``delta`` after the rounds so far, from ``dp_accounting``'s RDP accountant."""

    def __init__(self, delta: float) -> None:
        import dp_accounting  # imported lazily: only runs with DP need the accountant
        from dp_accounting.rdp import rdp_privacy_accountant

        self._dp = dp_accounting
        self._factory = rdp_privacy_accountant.RdpAccountant
        self.delta = delta
        self._events: list[float] = []

    @property
    def rounds(self) -> int:
        return len(self._events)

    def _epsilon_of(self, multipliers: list[float]) -> float:
        if not multipliers:
            return 0.0
        accountant = self._factory()
        for z in multipliers:
            accountant.compose(self._dp.GaussianDpEvent(z))
        return float(accountant.get_epsilon(self.delta))

    def epsilon(self) -> float:
        return self._epsilon_of(self._events)

    def epsilon_after(self, noise_multiplier: float) -> float:
        """Epsilon if one more round with ``noise_multiplier`` were released (to check a budget)."""
        return self._epsilon_of([*self._events, noise_multiplier])

    def allows(self, noise_multiplier: float, budget: float | None) -> bool:
        """Whether one more round keeps epsilon within ``budget`` (``None``: no budget)."""
        return budget is None or self.epsilon_after(noise_multiplier) <= budget

    def step(self, noise_multiplier: float) -> float:
        """Record one released round; returns the new epsilon."""
        if not noise_multiplier > 0:
            raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
        self._events.append(noise_multiplier)
        return self.epsilon()

    def state(self) -> dict[str, Any]:
        return {"delta": self.delta, "noise_multipliers": list(self._events)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.delta = float(state["delta"])
        self._events = [float(z) for z in state["noise_multipliers"]]
