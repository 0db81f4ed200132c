"""A store of KV blocks (RAM, then optionally SSD) and the KvCache gRPC service over it
(proto/cognitora/v1/kvcached.proto): cgn-kvcached serves a node's store with it, and a
prefill engine serves the blocks it holds for a transfer with it (RAM only), so a decode
engine fetches either through the same client, in the same format."""
