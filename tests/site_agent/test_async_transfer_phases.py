"""The asynchronous runner's phase table is shared by three threads: the follower and the
sender add their transfer seconds while the trainer takes the table with its next update. A
follower that added into a table the trainer was emptying failed the site (KeyError 'apply')."""

from __future__ import annotations

import threading

from geoloco.site_agent.async_rounds import AsyncRounds


def test_transfer_seconds_are_added_under_the_lock_the_trainer_takes_them_with() -> None:
    runner = AsyncRounds.__new__(AsyncRounds)  # only the phase table and its lock are exercised
    runner._changed = threading.Condition()
    runner.transfer_phases_s = {"wait": 1.0}
    with runner._changed:  # the trainer taking the table
        adder = threading.Thread(target=runner._add_phases, args=({"wait": 0.5, "apply": 2.0},))
        adder.start()
        adder.join(timeout=0.3)
        assert adder.is_alive(), "the follower added its seconds while the trainer held the table"
        assert runner.transfer_phases_s == {"wait": 1.0}
        runner.transfer_phases_s.clear()
    adder.join(timeout=10.0)
    assert not adder.is_alive()
    assert runner.transfer_phases_s == {"wait": 0.5, "apply": 2.0}
