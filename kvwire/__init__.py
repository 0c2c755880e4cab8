"""What the daemon (kvservice) and its clients (engine_client, model_runner) share, and nothing else:
the generated protocol (kvwire.v1), block and session ids (ids), and the registration socket's
framing (peer_socket). No torch, no daemon code: an engine needs only this and grpcio/protobuf.
"""
