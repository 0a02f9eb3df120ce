"""``parallel_streams = "auto"``: K from the measured throughput of the site's own transfers
(``StreamTuner``), pure logic fed with made-up links."""

from __future__ import annotations

from collections.abc import Callable

from geoloco.site_agent.client_streams import MIN_MEASURED_BYTES, REPROBE_AFTER, StreamTuner

MiB = 1 << 20
GiB = 1 << 30


def _run(tuner: StreamTuner, link: Callable[[int], float], transfers: int, nbytes: int = GiB) -> list[int]:
    """K of each of ``transfers`` transfers of ``nbytes`` over a link moving ``link(K)`` bytes/s."""
    chosen = []
    for _ in range(transfers):
        k = tuner.choose(nbytes, nbytes // MiB)
        chosen.append(k)
        tuner.observe(k, nbytes, nbytes / link(k))
    return chosen


def test_a_window_bound_link_grows_k_while_more_streams_help() -> None:
    # Each flow is capped at 100 MB/s by its window; the link carries 350 MB/s.
    chosen = _run(StreamTuner(), lambda k: min(100e6 * k, 350e6), 8)
    assert chosen[:3] == [1, 2, 4]  # 2 helped (2x), 4 helped (3.5x vs 1)
    assert set(chosen[3:]) == {4}  # the size ceiling for 1 GiB is 4 streams


def test_a_link_one_stream_fills_stays_at_one_stream_after_one_probe() -> None:
    chosen = _run(StreamTuner(), lambda k: 500e6 * (1.0 - 0.02 * k), 10)  # loopback: CPU-bound
    assert chosen[:2] == [1, 2]
    assert set(chosen[2:]) == {1}


def test_more_streams_that_helped_only_a_little_are_not_kept() -> None:
    chosen = _run(StreamTuner(), lambda k: 100e6 * (1.1 if k > 1 else 1.0), 6)  # +10% < 15%
    assert chosen == [1, 2, 1, 1, 1, 1]


def test_the_next_k_is_tried_again_after_a_while_and_kept_when_the_link_changed() -> None:
    tuner = StreamTuner()
    _run(tuner, lambda k: 100e6, 2)  # 1, then a probe of 2 that did not help
    assert tuner.current == 1
    chosen = _run(tuner, lambda k: min(100e6 * k, 400e6), REPROBE_AFTER + 3)
    assert chosen[:REPROBE_AFTER] == [1] * REPROBE_AFTER
    assert chosen[REPROBE_AFTER] == 2 and chosen[-1] == 4


def test_k_falls_back_when_fewer_streams_became_faster() -> None:
    tuner = StreamTuner(smoothing=1.0)
    _run(tuner, lambda k: min(100e6 * k, 400e6), 3)
    assert tuner.current == 4
    _run(tuner, lambda k: 400e6 / k, 1)  # more streams now hurt (e.g. a congested middlebox)
    assert tuner.current == 2  # the fastest K measured: 2 ran at 200 MB/s, 4 now at 100
    tuner.rates[1] = 400e6  # and once one stream is measured faster than two ...
    tuner.observe(2, 1 << 30, (1 << 30) / 200e6)
    assert tuner.current == 1  # ... K falls back to one


def test_small_payloads_get_one_stream_and_teach_nothing() -> None:
    tuner = StreamTuner()
    chosen = _run(tuner, lambda k: 100e6 * k, 4, nbytes=MIN_MEASURED_BYTES - 1)
    assert chosen == [1, 1, 1, 1] and tuner.rates == {}
    assert tuner.choose(100 * MiB, 100) == 1  # nothing measured yet: start at one
    tuner.observe(1, 100 * MiB, 1.0)
    assert tuner.choose(100 * MiB, 100) == 2  # 100 MiB allows two streams: probe the second
    assert tuner.choose(100 * MiB, 1) == 1  # never more streams than chunks
