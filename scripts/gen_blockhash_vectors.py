"""Write cgn_core/kv/testdata/blockhash_vectors.json (run once; the file is committed).

The vectors pin the block-hash contract of docs/architecture.md, block-hash contract so that every
implementation (router, engines, KV daemon, other languages) can check itself.
tests/test_blockhash.py recomputes them with an independent reference.
"""

import json
from pathlib import Path

from cgn_core.kv.blockhash import block_hashes, namespace, tenant_salt

TENANT_ACME, GROUP_ACME = tenant_salt("tenant", "acme"), tenant_salt("group", "acme")
CASES = [
    ("empty prompt", "SmolLM2-135M-Instruct", None, []),
    ("partial block only", "SmolLM2-135M-Instruct", None, list(range(15))),
    ("one block", "SmolLM2-135M-Instruct", None, list(range(16))),
    ("two blocks and a tail", "SmolLM2-135M-Instruct", None, [i * 7 % 49152 for i in range(40)]),
    ("tenant salt", "SmolLM2-135M-Instruct", "tenant-a", list(range(16))),
    ("other model", "qwen2.5-coder-0.5b", None, list(range(16))),
    ("max token id", "m", None, [2**32 - 1] * 16 + [0] * 16),
    ("unicode model name", "модель-7b", "adapter:é", [1, 2, 3, 4] * 12),
    ("tenant acme's derived salt", "SmolLM2-135M-Instruct", TENANT_ACME, list(range(16))),
    ("group acme's derived salt", "SmolLM2-135M-Instruct", GROUP_ACME, list(range(16))),
]
SALTS = [("tenant", "acme"), ("group", "acme"), ("tenant", "tenant-b"), ("group", "café")]

out = []
for name, model, salt, tokens in CASES:
    ns = namespace(model, salt)
    out.append(
        {
            "name": name,
            "model": model,
            "salt": salt,
            "namespace": ns,
            "tokens": tokens,
            "hashes": [h.hex() for h in block_hashes(tokens, ns)],
        }
    )
path = Path(__file__).resolve().parent.parent / "cgn_core/kv/testdata/blockhash_vectors.json"
path.write_text(
    json.dumps(
        {
            "scheme": "cognitora.kv.v1",
            "block_size": 16,
            "vectors": out,
            "salts": [{"kind": k, "name": n, "salt": tenant_salt(k, n)} for k, n in SALTS],
        },
        indent=1,
        ensure_ascii=False,
    )
    + "\n"
)
print(f"wrote {len(out)} vectors to {path}")
