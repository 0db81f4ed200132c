"""The KV wing: everything that names, moves or keeps a prompt's KV-cache blocks.

* `blockhash`: the block-hash contract (docs/architecture.md), how router, engines and
  stores name a block.
* `layout`: what a serialized block is (dtype, layers, heads, dims); blocks of another
  layout are never exchanged.
* `events`: the KV-event hub and its SSE encoding (engines and cgn-kvcached publish what
  they hold).
* `transfer`: a prefill leg's `kv_transfer_params` (the P/D protocol); pure.
* `store`, `ram_tier`, `ssd_tier`: a sans-I/O block store, RAM with an LRU byte budget,
  then checksummed files.
* `service`: the KvCache gRPC service over a store (cgn-kvcached; a prefill engine's
  transfer source).
* `client`: its client; engines restore from and offer to a node's store, decode engines
  fetch their legs' blocks.
"""
