"""An upload whose manifest carries a metric that is not a number (a loop that reports no loss,
an old or third-party client) is one upload across its streams: the second stream resumes the
first instead of replacing it, and the metric is left out of the round's record."""

from __future__ import annotations

import itertools
import math

import torch
from _round_helpers import chunk_requests, encode_update, join, tiny_weights, upload_manifest

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator import translate
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.rounds import RoundStateMachine
from geoloco.protos import geoloco_pb2 as pb


def test_a_nan_metric_does_not_make_a_resumed_upload_a_new_one() -> None:
    weights, layout = tiny_weights()
    config = CoordinatorConfig(algorithm=AlgorithmConfig(inner_steps=2), insecure=True, total_rounds=2, min_sites=1)
    rounds = RoundStateMachine(config, weights, layout)
    join(rounds, "a")
    data, codec = encode_update(torch.full((rounds.numel,), 0.01), "none")
    manifest = upload_manifest(rounds.session_id, 0, data, codec=codec, numel=rounds.numel, site="a", chunk_size=16)
    manifest.metrics["train_loss"] = math.nan
    manifest.metrics["inner_time_s"] = 1.5
    chunks = list(translate.upload_chunks(chunk_requests(manifest, data)))
    assert len(chunks) > 2
    first = rounds.receive_upload("a", translate.upload_spec(manifest, "a"), iter(chunks[:2]))
    assert not first.complete
    # The second stream parses its own copy of the manifest (another NaN object) and sends the rest.
    resent = pb.UploadManifest.FromString(manifest.SerializeToString())
    second = rounds.receive_upload("a", translate.upload_spec(resent, "a"), itertools.islice(chunks, 2, None))
    assert second.complete, "the second stream replaced the first instead of resuming it"
    record = rounds.poll()
    assert record is not None and record.site_metrics == {"a": {"inner_time_s": 1.5}}
