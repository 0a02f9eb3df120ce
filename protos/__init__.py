"""geoloco.protos: the wire protocol between the coordinator and its sites.

- ``geoloco.proto`` -- the schema (package ``geoloco.v1``, service ``Coordinator``);
  ``geoloco_pb2`` / ``geoloco_pb2_grpc`` -- its generated code (committed; regenerate with
  ``python protos/regenerate.py``, checked by ``.ci/check_protos.sh``).
- ``wire`` -- big buffers as chunk streams: manifests, checksums, validated reassembly, resume.
- ``transport`` -- gRPC options, deadlines, TLS servers and channels, site identity, errors.
- ``identity`` -- site names and how certificates carry them.
- ``errors`` -- exceptions that carry the gRPC status a peer should see.

Nothing is imported here, so ``import geoloco.protos.identity`` stays free of grpc/protobuf.
"""
