"""geoloco.protos: the wire protocol between the coordinator and its sites.

- ``geoloco.proto`` -- the schema (package ``geoloco.v1``, service ``Coordinator``);
  ``geoloco_pb2`` / ``geoloco_pb2_grpc`` -- its generated code (committed; regenerate with
  ``python protos/regenerate.py``, checked by ``.ci/check_protos.sh``).
- ``wire_buffers`` / ``wire_manifests`` / ``wire_chunks`` / ``wire_assembly`` / ``wire_files`` --
  big buffers as chunk streams: sizes and checksums, manifests, send streams, validated
  reassembly and resume, blobs served from a file.
- ``transport_options`` / ``transport_tls`` / ``transport_errors`` / ``transport_malloc`` /
  ``transport_endpoints`` -- gRPC options and deadlines, TLS and the site a certificate names,
  errors to statuses, malloc tunables, and servers, channels and stubs with the chunk fast path.
- ``protocol_version`` -- ``PROTOCOL_VERSION``, which a site sends in Join.
- ``identity`` -- site names and how certificates carry them.
- ``errors`` -- exceptions that carry the gRPC status a peer should see (update refusals too).
- ``upload_check`` -- an upload decoded and checked (finite, its norm) piece by piece, by the
  coordinator and by a relay.
- ``atomic_files`` / ``folder_lock`` / ``tensorboard`` -- crash-safe files, one process per
  folder, and a round record's scalars as TensorBoard events: files the coordinator, the sites
  and the research tools write alike.

Nothing is imported here, so ``import geoloco.protos.identity`` stays free of grpc/protobuf.
"""
