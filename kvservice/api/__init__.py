"""The daemon's edges: the gRPC server and its servicers (protobuf in, a core call, protobuf out),
the registration socket, the per-peer guard and the protobuf <-> core conversions.
"""
