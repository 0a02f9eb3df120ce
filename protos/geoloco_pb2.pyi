from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_STALE_SESSION: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_A_MEMBER: _ClassVar[ErrorReason]
    ERROR_REASON_WRONG_ROUND: _ClassVar[ErrorReason]
    ERROR_REASON_MANIFEST_CONFLICT: _ClassVar[ErrorReason]
    ERROR_REASON_CHECKSUM_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_CHUNK_OUT_OF_BOUNDS: _ClassVar[ErrorReason]
    ERROR_REASON_BAD_MANIFEST: _ClassVar[ErrorReason]
    ERROR_REASON_IDENTITY_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_RUN_FINISHED: _ClassVar[ErrorReason]
    ERROR_REASON_PROTOCOL_VERSION: _ClassVar[ErrorReason]
    ERROR_REASON_BAD_STAGE_MESSAGE: _ClassVar[ErrorReason]
    ERROR_REASON_SITE_REPLACED: _ClassVar[ErrorReason]

class ChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_ALGORITHM_UNSPECIFIED: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_CRC32: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_SHA256: _ClassVar[ChecksumAlgorithm]

class Weighting(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHTING_UNSPECIFIED: _ClassVar[Weighting]
    WEIGHTING_SAMPLES: _ClassVar[Weighting]
    WEIGHTING_UNIFORM: _ClassVar[Weighting]
    WEIGHTING_STEPS: _ClassVar[Weighting]

class SitePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SITE_PHASE_UNSPECIFIED: _ClassVar[SitePhase]
    SITE_PHASE_FETCHING: _ClassVar[SitePhase]
    SITE_PHASE_TRAINING: _ClassVar[SitePhase]
    SITE_PHASE_UPLOADING: _ClassVar[SitePhase]
    SITE_PHASE_WAITING: _ClassVar[SitePhase]

class BroadcastAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BROADCAST_ACTION_UNSPECIFIED: _ClassVar[BroadcastAction]
    BROADCAST_ACTION_APPLY_DELTA: _ClassVar[BroadcastAction]
    BROADCAST_ACTION_RESYNC: _ClassVar[BroadcastAction]
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_STALE_SESSION: ErrorReason
ERROR_REASON_NOT_A_MEMBER: ErrorReason
ERROR_REASON_WRONG_ROUND: ErrorReason
ERROR_REASON_MANIFEST_CONFLICT: ErrorReason
ERROR_REASON_CHECKSUM_MISMATCH: ErrorReason
ERROR_REASON_CHUNK_OUT_OF_BOUNDS: ErrorReason
ERROR_REASON_BAD_MANIFEST: ErrorReason
ERROR_REASON_IDENTITY_MISMATCH: ErrorReason
ERROR_REASON_RUN_FINISHED: ErrorReason
ERROR_REASON_PROTOCOL_VERSION: ErrorReason
ERROR_REASON_BAD_STAGE_MESSAGE: ErrorReason
ERROR_REASON_SITE_REPLACED: ErrorReason
CHECKSUM_ALGORITHM_UNSPECIFIED: ChecksumAlgorithm
CHECKSUM_ALGORITHM_CRC32: ChecksumAlgorithm
CHECKSUM_ALGORITHM_SHA256: ChecksumAlgorithm
WEIGHTING_UNSPECIFIED: Weighting
WEIGHTING_SAMPLES: Weighting
WEIGHTING_UNIFORM: Weighting
WEIGHTING_STEPS: Weighting
SITE_PHASE_UNSPECIFIED: SitePhase
SITE_PHASE_FETCHING: SitePhase
SITE_PHASE_TRAINING: SitePhase
SITE_PHASE_UPLOADING: SitePhase
SITE_PHASE_WAITING: SitePhase
BROADCAST_ACTION_UNSPECIFIED: BroadcastAction
BROADCAST_ACTION_APPLY_DELTA: BroadcastAction
BROADCAST_ACTION_RESYNC: BroadcastAction

class Checksum(_message.Message):
    __slots__ = ("algorithm", "digest")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    algorithm: ChecksumAlgorithm
    digest: bytes
    def __init__(self, algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., digest: _Optional[bytes] = ...) -> None: ...

class IndexRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class BlobManifest(_message.Message):
    __slots__ = ("total_bytes", "chunk_size", "num_chunks", "checksum", "codec", "shape", "dtype")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    chunk_size: int
    num_chunks: int
    checksum: Checksum
    codec: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, total_bytes: _Optional[int] = ..., chunk_size: _Optional[int] = ..., num_chunks: _Optional[int] = ..., checksum: _Optional[_Union[Checksum, _Mapping]] = ..., codec: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorLayout(_message.Message):
    __slots__ = ("name", "shape", "offset", "numel")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    numel: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class ModelLayout(_message.Message):
    __slots__ = ("tensors", "numel", "dtype")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorLayout]
    numel: int
    dtype: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorLayout, _Mapping]]] = ..., numel: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class RunConfig(_message.Message):
    __slots__ = ("inner_steps", "uplink_codec", "downlink_codec", "seed", "weighting", "total_rounds", "quorum", "round_deadline_ms", "heartbeat_interval_ms", "heartbeat_timeout_ms", "config_json")
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    UPLINK_CODEC_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_CODEC_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTING_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    ROUND_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    inner_steps: int
    uplink_codec: str
    downlink_codec: str
    seed: int
    weighting: Weighting
    total_rounds: int
    quorum: int
    round_deadline_ms: int
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    config_json: str
    def __init__(self, inner_steps: _Optional[int] = ..., uplink_codec: _Optional[str] = ..., downlink_codec: _Optional[str] = ..., seed: _Optional[int] = ..., weighting: _Optional[_Union[Weighting, str]] = ..., total_rounds: _Optional[int] = ..., quorum: _Optional[int] = ..., round_deadline_ms: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ..., config_json: _Optional[str] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("round", "round_seed", "deadline_remaining_ms", "uplink_codec", "fastest_step_s", "upload_numel", "fragment")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_SEED_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    UPLINK_CODEC_FIELD_NUMBER: _ClassVar[int]
    FASTEST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_NUMEL_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    round: int
    round_seed: int
    deadline_remaining_ms: int
    uplink_codec: str
    fastest_step_s: float
    upload_numel: int
    fragment: int
    def __init__(self, round: _Optional[int] = ..., round_seed: _Optional[int] = ..., deadline_remaining_ms: _Optional[int] = ..., uplink_codec: _Optional[str] = ..., fastest_step_s: _Optional[float] = ..., upload_numel: _Optional[int] = ..., fragment: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("site", "protocol_version", "software_version", "has_weights", "weights_round", "weights_digest", "instance_id")
    SITE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ROUND_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    site: str
    protocol_version: int
    software_version: str
    has_weights: bool
    weights_round: int
    weights_digest: Checksum
    instance_id: str
    def __init__(self, site: _Optional[str] = ..., protocol_version: _Optional[int] = ..., software_version: _Optional[str] = ..., has_weights: bool = ..., weights_round: _Optional[int] = ..., weights_digest: _Optional[_Union[Checksum, _Mapping]] = ..., instance_id: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("session_id", "site", "config", "round", "layout", "weights_digest", "must_fetch_model", "protocol_version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MUST_FETCH_MODEL_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    site: str
    config: RunConfig
    round: RoundInfo
    layout: ModelLayout
    weights_digest: Checksum
    must_fetch_model: bool
    protocol_version: int
    def __init__(self, session_id: _Optional[str] = ..., site: _Optional[str] = ..., config: _Optional[_Union[RunConfig, _Mapping]] = ..., round: _Optional[_Union[RoundInfo, _Mapping]] = ..., layout: _Optional[_Union[ModelLayout, _Mapping]] = ..., weights_digest: _Optional[_Union[Checksum, _Mapping]] = ..., must_fetch_model: bool = ..., protocol_version: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("site", "session_id", "round", "phase", "inner_steps_done", "instance_id")
    SITE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    site: str
    session_id: str
    round: int
    phase: SitePhase
    inner_steps_done: int
    instance_id: str
    def __init__(self, site: _Optional[str] = ..., session_id: _Optional[str] = ..., round: _Optional[int] = ..., phase: _Optional[_Union[SitePhase, str]] = ..., inner_steps_done: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("rejoin_required", "round", "run_finished")
    REJOIN_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RUN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    rejoin_required: bool
    round: RoundInfo
    run_finished: bool
    def __init__(self, rejoin_required: bool = ..., round: _Optional[_Union[RoundInfo, _Mapping]] = ..., run_finished: bool = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("site", "session_id", "reason", "instance_id")
    SITE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    site: str
    session_id: str
    reason: str
    instance_id: str
    def __init__(self, site: _Optional[str] = ..., session_id: _Optional[str] = ..., reason: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FetchModelRequest(_message.Message):
    __slots__ = ("site", "session_id", "start_chunk", "expect_digest", "chunk_stride", "shard", "instance_id")
    SITE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_CHUNK_FIELD_NUMBER: _ClassVar[int]
    EXPECT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    site: str
    session_id: str
    start_chunk: int
    expect_digest: Checksum
    chunk_stride: int
    shard: ShardRef
    instance_id: str
    def __init__(self, site: _Optional[str] = ..., session_id: _Optional[str] = ..., start_chunk: _Optional[int] = ..., expect_digest: _Optional[_Union[Checksum, _Mapping]] = ..., chunk_stride: _Optional[int] = ..., shard: _Optional[_Union[ShardRef, _Mapping]] = ..., instance_id: _Optional[str] = ...) -> None: ...

class ShardRef(_message.Message):
    __slots__ = ("index", "count", "split")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    split: str
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., split: _Optional[str] = ...) -> None: ...

class ModelManifest(_message.Message):
    __slots__ = ("round", "layout", "blob", "start_chunk", "shard_rows")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    START_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SHARD_ROWS_FIELD_NUMBER: _ClassVar[int]
    round: int
    layout: ModelLayout
    blob: BlobManifest
    start_chunk: int
    shard_rows: bool
    def __init__(self, round: _Optional[int] = ..., layout: _Optional[_Union[ModelLayout, _Mapping]] = ..., blob: _Optional[_Union[BlobManifest, _Mapping]] = ..., start_chunk: _Optional[int] = ..., shard_rows: bool = ...) -> None: ...

class FetchModelResponse(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: ModelManifest
    chunk: Chunk
    def __init__(self, manifest: _Optional[_Union[ModelManifest, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class UploadManifest(_message.Message):
    __slots__ = ("site", "session_id", "round", "fragment", "sample_weight", "blob", "metrics", "inner_steps", "instance_id", "relayed_sites", "shard_index", "shard_count", "shard_split")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SITE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RELAYED_SITES_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    SHARD_SPLIT_FIELD_NUMBER: _ClassVar[int]
    site: str
    session_id: str
    round: int
    fragment: int
    sample_weight: float
    blob: BlobManifest
    metrics: _containers.ScalarMap[str, float]
    inner_steps: int
    instance_id: str
    relayed_sites: _containers.RepeatedCompositeFieldContainer[RelayedSite]
    shard_index: int
    shard_count: int
    shard_split: str
    def __init__(self, site: _Optional[str] = ..., session_id: _Optional[str] = ..., round: _Optional[int] = ..., fragment: _Optional[int] = ..., sample_weight: _Optional[float] = ..., blob: _Optional[_Union[BlobManifest, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., inner_steps: _Optional[int] = ..., instance_id: _Optional[str] = ..., relayed_sites: _Optional[_Iterable[_Union[RelayedSite, _Mapping]]] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., shard_split: _Optional[str] = ...) -> None: ...

class RelayedSite(_message.Message):
    __slots__ = ("site", "weight", "inner_steps", "metrics", "rejected", "left_out")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SITE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    site: str
    weight: float
    inner_steps: int
    metrics: _containers.ScalarMap[str, float]
    rejected: str
    left_out: bool
    def __init__(self, site: _Optional[str] = ..., weight: _Optional[float] = ..., inner_steps: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., rejected: _Optional[str] = ..., left_out: bool = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: UploadManifest
    chunk: Chunk
    def __init__(self, manifest: _Optional[_Union[UploadManifest, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class UploadResponse(_message.Message):
    __slots__ = ("complete", "missing", "received_bytes", "folded_late", "merged_round")
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FOLDED_LATE_FIELD_NUMBER: _ClassVar[int]
    MERGED_ROUND_FIELD_NUMBER: _ClassVar[int]
    complete: bool
    missing: _containers.RepeatedCompositeFieldContainer[IndexRange]
    received_bytes: int
    folded_late: bool
    merged_round: int
    def __init__(self, complete: bool = ..., missing: _Optional[_Iterable[_Union[IndexRange, _Mapping]]] = ..., received_bytes: _Optional[int] = ..., folded_late: bool = ..., merged_round: _Optional[int] = ...) -> None: ...

class UploadStatusRequest(_message.Message):
    __slots__ = ("site", "session_id", "round", "fragment", "instance_id")
    SITE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    site: str
    session_id: str
    round: int
    fragment: int
    instance_id: str
    def __init__(self, site: _Optional[str] = ..., session_id: _Optional[str] = ..., round: _Optional[int] = ..., fragment: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class UploadStatusResponse(_message.Message):
    __slots__ = ("known", "manifest", "received", "missing", "complete", "folded_late", "merged_round")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    FOLDED_LATE_FIELD_NUMBER: _ClassVar[int]
    MERGED_ROUND_FIELD_NUMBER: _ClassVar[int]
    known: bool
    manifest: UploadManifest
    received: _containers.RepeatedCompositeFieldContainer[IndexRange]
    missing: _containers.RepeatedCompositeFieldContainer[IndexRange]
    complete: bool
    folded_late: bool
    merged_round: int
    def __init__(self, known: bool = ..., manifest: _Optional[_Union[UploadManifest, _Mapping]] = ..., received: _Optional[_Iterable[_Union[IndexRange, _Mapping]]] = ..., missing: _Optional[_Iterable[_Union[IndexRange, _Mapping]]] = ..., complete: bool = ..., folded_late: bool = ..., merged_round: _Optional[int] = ...) -> None: ...

class AwaitBroadcastRequest(_message.Message):
    __slots__ = ("site", "session_id", "round", "fragment", "start_chunk", "chunk_stride", "shard", "instance_id", "withheld")
    SITE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    START_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    WITHHELD_FIELD_NUMBER: _ClassVar[int]
    site: str
    session_id: str
    round: int
    fragment: int
    start_chunk: int
    chunk_stride: int
    shard: ShardRef
    instance_id: str
    withheld: str
    def __init__(self, site: _Optional[str] = ..., session_id: _Optional[str] = ..., round: _Optional[int] = ..., fragment: _Optional[int] = ..., start_chunk: _Optional[int] = ..., chunk_stride: _Optional[int] = ..., shard: _Optional[_Union[ShardRef, _Mapping]] = ..., instance_id: _Optional[str] = ..., withheld: _Optional[str] = ...) -> None: ...

class BroadcastHeader(_message.Message):
    __slots__ = ("action", "round", "included", "num_contributors", "delta", "weights_digest", "next_round", "run_finished", "start_chunk", "shard_rows", "shard_weights_digest", "refused")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    RUN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    START_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SHARD_ROWS_FIELD_NUMBER: _ClassVar[int]
    SHARD_WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    action: BroadcastAction
    round: int
    included: bool
    num_contributors: int
    delta: BlobManifest
    weights_digest: Checksum
    next_round: RoundInfo
    run_finished: bool
    start_chunk: int
    shard_rows: bool
    shard_weights_digest: Checksum
    refused: bool
    def __init__(self, action: _Optional[_Union[BroadcastAction, str]] = ..., round: _Optional[int] = ..., included: bool = ..., num_contributors: _Optional[int] = ..., delta: _Optional[_Union[BlobManifest, _Mapping]] = ..., weights_digest: _Optional[_Union[Checksum, _Mapping]] = ..., next_round: _Optional[_Union[RoundInfo, _Mapping]] = ..., run_finished: bool = ..., start_chunk: _Optional[int] = ..., shard_rows: bool = ..., shard_weights_digest: _Optional[_Union[Checksum, _Mapping]] = ..., refused: bool = ...) -> None: ...

class RoundProgress(_message.Message):
    __slots__ = ("round", "uploads_complete", "quorum", "deadline_remaining_ms")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    UPLOADS_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    round: int
    uploads_complete: int
    quorum: int
    deadline_remaining_ms: int
    def __init__(self, round: _Optional[int] = ..., uploads_complete: _Optional[int] = ..., quorum: _Optional[int] = ..., deadline_remaining_ms: _Optional[int] = ...) -> None: ...

class AwaitBroadcastResponse(_message.Message):
    __slots__ = ("progress", "header", "chunk")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    progress: RoundProgress
    header: BroadcastHeader
    chunk: Chunk
    def __init__(self, progress: _Optional[_Union[RoundProgress, _Mapping]] = ..., header: _Optional[_Union[BroadcastHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class SecAggKeyAdvert(_message.Message):
    __slots__ = ("site", "session", "round", "cipher_public_key", "mask_public_key", "signature", "seed_commitment")
    SITE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CIPHER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    MASK_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    site: int
    session: str
    round: int
    cipher_public_key: bytes
    mask_public_key: bytes
    signature: bytes
    seed_commitment: bytes
    def __init__(self, site: _Optional[int] = ..., session: _Optional[str] = ..., round: _Optional[int] = ..., cipher_public_key: _Optional[bytes] = ..., mask_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., seed_commitment: _Optional[bytes] = ...) -> None: ...

class SecAggIdentityBinding(_message.Message):
    __slots__ = ("name", "identity_key", "certificate_pem", "signature")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_KEY_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    name: str
    identity_key: bytes
    certificate_pem: bytes
    signature: bytes
    def __init__(self, name: _Optional[str] = ..., identity_key: _Optional[bytes] = ..., certificate_pem: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SecAggEncryptedShare(_message.Message):
    __slots__ = ("sender", "recipient", "round", "ciphertext")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    sender: int
    recipient: int
    round: int
    ciphertext: bytes
    def __init__(self, sender: _Optional[int] = ..., recipient: _Optional[int] = ..., round: _Optional[int] = ..., ciphertext: _Optional[bytes] = ...) -> None: ...

class SecAggUnmaskRequest(_message.Message):
    __slots__ = ("round", "survivors", "dropped", "signatures")
    class SignaturesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    round: int
    survivors: _containers.RepeatedScalarFieldContainer[int]
    dropped: _containers.RepeatedScalarFieldContainer[int]
    signatures: _containers.ScalarMap[int, bytes]
    def __init__(self, round: _Optional[int] = ..., survivors: _Optional[_Iterable[int]] = ..., dropped: _Optional[_Iterable[int]] = ..., signatures: _Optional[_Mapping[int, bytes]] = ...) -> None: ...

class SecAggUnmaskResponse(_message.Message):
    __slots__ = ("site", "round", "self_mask_shares", "mask_key_shares")
    class SelfMaskSharesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    class MaskKeySharesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    SITE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SELF_MASK_SHARES_FIELD_NUMBER: _ClassVar[int]
    MASK_KEY_SHARES_FIELD_NUMBER: _ClassVar[int]
    site: int
    round: int
    self_mask_shares: _containers.ScalarMap[int, bytes]
    mask_key_shares: _containers.ScalarMap[int, bytes]
    def __init__(self, site: _Optional[int] = ..., round: _Optional[int] = ..., self_mask_shares: _Optional[_Mapping[int, bytes]] = ..., mask_key_shares: _Optional[_Mapping[int, bytes]] = ...) -> None: ...

class SecAggAdvertiseKeys(_message.Message):
    __slots__ = ("advert", "binding")
    ADVERT_FIELD_NUMBER: _ClassVar[int]
    BINDING_FIELD_NUMBER: _ClassVar[int]
    advert: SecAggKeyAdvert
    binding: SecAggIdentityBinding
    def __init__(self, advert: _Optional[_Union[SecAggKeyAdvert, _Mapping]] = ..., binding: _Optional[_Union[SecAggIdentityBinding, _Mapping]] = ...) -> None: ...

class SecAggAdvertisements(_message.Message):
    __slots__ = ("names", "adverts", "bindings")
    class NamesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    NAMES_FIELD_NUMBER: _ClassVar[int]
    ADVERTS_FIELD_NUMBER: _ClassVar[int]
    BINDINGS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.ScalarMap[int, str]
    adverts: _containers.RepeatedCompositeFieldContainer[SecAggKeyAdvert]
    bindings: _containers.RepeatedCompositeFieldContainer[SecAggIdentityBinding]
    def __init__(self, names: _Optional[_Mapping[int, str]] = ..., adverts: _Optional[_Iterable[_Union[SecAggKeyAdvert, _Mapping]]] = ..., bindings: _Optional[_Iterable[_Union[SecAggIdentityBinding, _Mapping]]] = ...) -> None: ...

class SecAggShareBundle(_message.Message):
    __slots__ = ("shares",)
    SHARES_FIELD_NUMBER: _ClassVar[int]
    shares: _containers.RepeatedCompositeFieldContainer[SecAggEncryptedShare]
    def __init__(self, shares: _Optional[_Iterable[_Union[SecAggEncryptedShare, _Mapping]]] = ...) -> None: ...

class SecAggSurvivors(_message.Message):
    __slots__ = ("sites",)
    SITES_FIELD_NUMBER: _ClassVar[int]
    sites: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sites: _Optional[_Iterable[str]] = ...) -> None: ...

class SecAggSurvivorSignature(_message.Message):
    __slots__ = ("signature",)
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    signature: bytes
    def __init__(self, signature: _Optional[bytes] = ...) -> None: ...

class SecureStageRequest(_message.Message):
    __slots__ = ("site", "session_id", "round", "stage", "wait_ms", "instance_id", "advertise_keys", "share_keys", "survivor_signature", "unmask_response")
    SITE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_KEYS_FIELD_NUMBER: _ClassVar[int]
    SHARE_KEYS_FIELD_NUMBER: _ClassVar[int]
    SURVIVOR_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    UNMASK_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    site: str
    session_id: str
    round: int
    stage: str
    wait_ms: int
    instance_id: str
    advertise_keys: SecAggAdvertiseKeys
    share_keys: SecAggShareBundle
    survivor_signature: SecAggSurvivorSignature
    unmask_response: SecAggUnmaskResponse
    def __init__(self, site: _Optional[str] = ..., session_id: _Optional[str] = ..., round: _Optional[int] = ..., stage: _Optional[str] = ..., wait_ms: _Optional[int] = ..., instance_id: _Optional[str] = ..., advertise_keys: _Optional[_Union[SecAggAdvertiseKeys, _Mapping]] = ..., share_keys: _Optional[_Union[SecAggShareBundle, _Mapping]] = ..., survivor_signature: _Optional[_Union[SecAggSurvivorSignature, _Mapping]] = ..., unmask_response: _Optional[_Union[SecAggUnmaskResponse, _Mapping]] = ...) -> None: ...

class SecureStageResponse(_message.Message):
    __slots__ = ("ready", "aborted", "abort_reason", "advertisements", "shares", "survivors", "unmask_request")
    READY_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    ABORT_REASON_FIELD_NUMBER: _ClassVar[int]
    ADVERTISEMENTS_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    UNMASK_REQUEST_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    aborted: bool
    abort_reason: str
    advertisements: SecAggAdvertisements
    shares: SecAggShareBundle
    survivors: SecAggSurvivors
    unmask_request: SecAggUnmaskRequest
    def __init__(self, ready: bool = ..., aborted: bool = ..., abort_reason: _Optional[str] = ..., advertisements: _Optional[_Union[SecAggAdvertisements, _Mapping]] = ..., shares: _Optional[_Union[SecAggShareBundle, _Mapping]] = ..., survivors: _Optional[_Union[SecAggSurvivors, _Mapping]] = ..., unmask_request: _Optional[_Union[SecAggUnmaskRequest, _Mapping]] = ...) -> None: ...
