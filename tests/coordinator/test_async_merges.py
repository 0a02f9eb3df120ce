"""Asynchronous merges in the coordinator without sockets: the grace window on a fake clock,
stale updates discounted or refused, one update per site and merge, a resend never counted
twice (also by a coordinator restarted from its durable state)."""

from __future__ import annotations

import pytest
import torch
from _round_helpers import FakeClock, encode_update, join, tiny_weights, upload, upload_manifest, upload_status

from geoloco.algorithms.async_merge import AsyncConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.rounds import RoundStateMachine
from geoloco.protos.errors import InvalidUpdateError, WrongRoundError

MERGE = AsyncConfig(enabled=True, min_quorum=1, grace_window_s=2.0, max_staleness=1, discount_per_version=0.5)


def make(clock: FakeClock, **overrides: object) -> RoundStateMachine:
    settings: dict[str, object] = {
        "algorithm": AlgorithmConfig(inner_steps=2, asynchronous=MERGE),
        "insecure": True,
        "total_rounds": 10,
    }
    settings.update(overrides)
    weights, layout = tiny_weights()
    return RoundStateMachine(CoordinatorConfig(**settings), weights, layout, clock=clock)  # type: ignore[arg-type]


def _update(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 0.01


def test_a_merge_waits_its_grace_window_then_takes_stale_updates_discounted() -> None:
    clock = FakeClock()
    rounds = make(clock)
    for site in ("a", "b", "c"):
        join(rounds, site)
    first = upload(rounds, "a", _update(1, rounds.numel), round_number=0)
    assert first.complete and first.merged_round == 0
    assert rounds.poll() is None  # the quorum is in; the 2 s grace window is not over
    clock.advance(2.5)
    record = rounds.poll()
    assert record is not None and record.participants == ["a"] and record.staleness == {"a": 0}
    assert record.excluded == []  # b and c are not late: a merge waits for nobody

    # b trained from version 0 too: it enters merge 1 one version behind, at half weight. Its
    # next update (from version 1) comes while merge 1 still holds the first: held for merge 2.
    late = upload(rounds, "b", _update(2, rounds.numel), round_number=0)
    assert late.merged_round == 1
    early = upload(rounds, "b", _update(3, rounds.numel), round_number=1)
    assert early.complete and early.merged_round == 2
    with pytest.raises(WrongRoundError, match="already has an update held for merge 2"):
        upload(rounds, "b", _update(4, rounds.numel), round_number=1)
    assert rounds.poll() is None  # the driver polls after every upload: the window starts
    clock.advance(2.5)
    record = rounds.poll()
    assert record is not None
    assert record.staleness == {"b": 1} and record.sample_weights == {"b": 0.5}
    # merge 2 opened with b's held update in it: fresh (computed from version 1, merged into 2)
    assert rounds.poll() is None
    clock.advance(2.5)
    record = rounds.poll()
    assert record is not None and record.staleness == {"b": 1} and record.participants == ["b"]

    # c's update from version 0 is three merges behind merge 3: over max_staleness 1.
    with pytest.raises(WrongRoundError, match="stale: computed from version 0, 3 merges behind"):
        upload(rounds, "c", _update(5, rounds.numel), round_number=0)
    with pytest.raises(WrongRoundError, match="does not exist yet"):
        upload(rounds, "c", _update(6, rounds.numel), round_number=4)


def test_a_resent_update_is_answered_with_its_merge_and_not_counted_again(tmp_path: object) -> None:
    clock = FakeClock()
    checkpoints = str(tmp_path)
    rounds = make(clock, checkpoint_dir=checkpoints)
    join(rounds, "a")
    join(rounds, "b")
    sent = _update(7, rounds.numel)
    assert upload(rounds, "a", sent, round_number=0).merged_round == 0
    assert upload(rounds, "b", _update(8, rounds.numel), round_number=0).merged_round == 0
    record = rounds.poll()  # both sites are in: no grace window to wait for
    assert record is not None and sorted(record.participants) == ["a", "b"]
    weights = rounds.weights.clone()

    again = upload(rounds, "a", sent, round_number=0)  # its answer was lost: sent again
    assert again.complete and again.merged_round == 0
    clock.advance(10)
    assert rounds.poll() is None and torch.equal(rounds.weights, weights)  # nothing entered merge 1

    rounds.close()  # a coordinator restarted from its durable state still knows
    restarted = make(clock, checkpoint_dir=checkpoints)
    assert restarted.round == 1
    join(restarted, "a")
    resent = upload(restarted, "a", sent, round_number=0)
    assert resent.complete and resent.merged_round == 0
    clock.advance(10)
    assert restarted.poll() is None and torch.equal(restarted.weights, weights)
    restarted.close()


def test_robust_aggregation_takes_an_asynchronous_merge_like_a_round() -> None:
    """A coordinate-wise median over a merge of every site's fresh update is the synchronous
    round's median, bit for bit."""
    updates = [_update(k, 23) for k in (11, 12, 13)]
    weights = []
    for merge in (AsyncConfig(enabled=True, min_quorum=3), AsyncConfig()):
        rounds = make(FakeClock(), algorithm=AlgorithmConfig(inner_steps=2, aggregation="median", asynchronous=merge))
        for site in "abc":
            join(rounds, site)
        for k, site in enumerate("abc"):
            upload(rounds, site, updates[k], round_number=0)
        record = rounds.poll()
        assert record is not None and sorted(record.participants) == ["a", "b", "c"]
        weights.append(rounds.weights.clone())
    assert torch.equal(weights[0], weights[1])


def test_two_updates_from_one_base_are_two_updates_not_a_resend() -> None:
    """A fast site's next update often has the same base version as the one already in the open
    merge: it is held for the next merge, and UploadStatus answers with the stored manifest (the
    site checks the checksum) rather than declaring a different update complete."""
    clock = FakeClock()
    rounds = make(clock, algorithm=AlgorithmConfig(inner_steps=2, asynchronous=AsyncConfig(enabled=True, min_quorum=2)))
    join(rounds, "a")
    join(rounds, "b")
    first, second = _update(21, rounds.numel), _update(22, rounds.numel)
    assert upload(rounds, "a", first, round_number=0).merged_round == 0
    assert upload(rounds, "a", second, round_number=0).merged_round == 1  # held, not a conflict
    status = upload_status(rounds, "a", rounds.session_id, 0, 0)
    assert status.known and status.complete and status.merged_round == 0  # the counted one...
    sent, codec = encode_update(first)
    own = upload_manifest(rounds.session_id, 0, sent, codec=codec, numel=rounds.numel)
    assert status.manifest.blob.checksum == own.blob.checksum  # ...named by its checksum
    assert upload(rounds, "b", _update(23, rounds.numel), round_number=0).merged_round == 0
    record = rounds.poll()
    assert record is not None and sorted(record.participants) == ["a", "b"]
    assert upload_status(rounds, "a", rounds.session_id, 0, 0).merged_round == 1  # the held one now


def test_a_site_whose_update_was_refused_sends_its_next_one_into_the_same_merge() -> None:
    """A merge needs ``min_quorum`` admitted updates; a refused one does not count. Held for the
    next merge, the refused site's next update would wait for a merge that can never close when
    the quorum is every site (with one site, always): it enters the open merge instead."""
    clock = FakeClock()
    rounds = make(clock, algorithm=AlgorithmConfig(inner_steps=2, asynchronous=AsyncConfig(enabled=True, min_quorum=2)))
    join(rounds, "a")
    join(rounds, "b")
    assert upload(rounds, "b", _update(31, rounds.numel), round_number=0).merged_round == 0
    with pytest.raises(InvalidUpdateError, match="norm"):
        upload(rounds, "a", torch.full((rounds.numel,), 1e5), round_number=0)  # over the norm floor
    assert rounds.poll() is None  # one update counted, the quorum is two
    assert upload(rounds, "a", _update(32, rounds.numel), round_number=0).merged_round == 0
    record = rounds.poll()
    assert record is not None and sorted(record.participants) == ["a", "b"]
    assert record.rejected == []  # its refused update is not the merge's last word on it
    assert upload(rounds, "a", _update(33, rounds.numel), round_number=1).merged_round == 1


def test_a_stale_update_is_weighed_against_the_others_as_it_enters_the_merge() -> None:
    """The guard's weight history holds the weights updates entered their merges with,
    discounted by their staleness (here 0.01 per version), and a merge admits an update with
    its discounted weight, as the simulator screens it. The manifest's check held the
    undiscounted weight against that history, so an update two versions stale (weight 1e-4
    in the merge) was refused as 1 against the others' 0.01, every time."""
    clock = FakeClock()
    merge = AsyncConfig(enabled=True, min_quorum=1, discount_per_version=0.01)
    rounds = make(clock, algorithm=AlgorithmConfig(inner_steps=2, asynchronous=merge))
    for site in ("a", "b", "c", "d"):
        join(rounds, site)
    for k, site in enumerate(("d", "a", "b", "c")):  # one merge each, from version 0: 1, 0.01, 1e-4, 1e-6
        assert upload(rounds, site, _update(k, rounds.numel), round_number=0).complete
        clock.advance(5.0)
        assert rounds.poll() is not None
    assert upload(rounds, "a", _update(9, rounds.numel), round_number=2).complete  # 2 stale: 1e-4
    clock.advance(5.0)
    record = rounds.poll()
    assert record is not None and record.participants == ["a"]
    assert record.sample_weights["a"] == pytest.approx(1e-4)
