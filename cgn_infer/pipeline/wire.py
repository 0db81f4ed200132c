"""What crosses the pipeline's wire, and the checks on it: activations, layer ranges, rows.

Activations are the residual stream [rows, hidden] between two parts of the model:
float32 (exact), float16, or int8: each row's OUTLIERS (4) largest magnitudes sent apart
(uint16 column + float16 value), the rest as symmetric int8 with one float16 scale per
GROUP (32) values, about 1.09 bytes a value. NOTE: llama-family residual streams carry a
few huge values (SmolLM2: 21,660 in a row whose median magnitude is 2). With a scale per
row the rest of such a row became 0 (greedy answers diverged within 5 tokens); with a
scale per 16 values and no outliers, top-1 agreement with float16 was 99.1 %; with the
outliers apart it is 99.7 % (SmolLM2) and 100 % (Qwen2.5-Coder-0.5B) over 1,024 tokens,
float32 weights (bench/results/pipeline.md).
Decoding validates sizes against the declared shape, so a
malformed message is an error naming what is wrong, never a wrong-sized array.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

from cgn_core.errors import ConfigError
from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.backends.paged import BatchItem
from cgn_proto.cognitora.v1 import pipeline_pb2 as pb

ACTIVATIONS = {"f32": pb.ACTIVATIONS_F32, "f16": pb.ACTIVATIONS_F16, "int8": pb.ACTIVATIONS_INT8}
_ITEMSIZE = {pb.ACTIVATIONS_F32: 4, pb.ACTIVATIONS_F16: 2, pb.ACTIVATIONS_INT8: 1}
GROUP = 32  # int8: values per scale
OUTLIERS = 4  # int8: values per row sent exactly (as float16)
MAX_MESSAGE = 256 << 20  # a 8k-token prompt chunk of a 8192-wide model in float32 is 256 MiB
# both ends of a pipeline stream: messages up to MAX_MESSAGE each way
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]


class WireError(ValueError):
    """A pipeline message that does not mean anything; the text says why."""


def encode(x: np.ndarray, dtype: int) -> pb.Hidden:
    """`x` [rows, cols] float32 as `dtype` (an `Activations` value)."""
    rows, cols = x.shape
    if dtype == pb.ACTIVATIONS_F32:
        return pb.Hidden(dtype=dtype, rows=rows, cols=cols, data=x.astype("<f4").tobytes())
    if dtype == pb.ACTIVATIONS_F16:
        return pb.Hidden(dtype=dtype, rows=rows, cols=cols, data=x.astype("<f2").tobytes())
    if dtype == pb.ACTIVATIONS_INT8:
        if cols % GROUP or cols < OUTLIERS:
            raise WireError(f"int8 activations need a hidden size divisible by {GROUP}")
        x = x.copy()
        idx = np.argpartition(-np.abs(x), OUTLIERS - 1, axis=1)[:, :OUTLIERS]  # [rows, K]
        apart = np.empty((rows, OUTLIERS), dtype=[("col", "<u2"), ("value", "<f2")])
        apart["col"], apart["value"] = idx, np.take_along_axis(x, idx, 1)
        np.put_along_axis(x, idx, 0.0, 1)
        g = x.reshape(rows, cols // GROUP, GROUP)
        scale = (np.abs(g).max(axis=2) / 127.0).astype("<f2")  # [rows, groups]
        scale = np.where(scale > 0, scale, np.float16(1.0)).astype("<f2")
        q = np.clip(np.rint(g / scale[..., None]), -127, 127).astype(np.int8)
        return pb.Hidden(
            dtype=dtype,
            rows=rows,
            cols=cols,
            data=q.tobytes(),
            scales=scale.tobytes(),
            outliers=apart.tobytes(),
            outliers_per_row=OUTLIERS,
        )
    raise WireError(f"unknown activation type {dtype}")


def decode(h: pb.Hidden, cols: int) -> np.ndarray:
    """The float32 [rows, cols] array `h` carries; WireError if it is not one."""
    if h.dtype not in _ITEMSIZE:
        raise WireError(f"unknown activation type {h.dtype}")
    if h.cols != cols:
        raise WireError(f"activations are {h.cols} wide, the model's hidden size is {cols}")
    if len(h.data) != h.rows * h.cols * _ITEMSIZE[h.dtype]:
        raise WireError(
            f"activations carry {len(h.data)} bytes for {h.rows} x {h.cols} "
            f"{pb.Activations.Name(h.dtype)}"
        )
    if h.dtype == pb.ACTIVATIONS_F32:
        return np.frombuffer(h.data, "<f4").reshape(h.rows, cols).copy()
    if h.dtype == pb.ACTIVATIONS_F16:
        return np.frombuffer(h.data, "<f2").reshape(h.rows, cols).astype(np.float32)
    groups = h.rows * (cols // GROUP)
    if cols % GROUP or len(h.scales) != 2 * groups:
        raise WireError(
            f"int8 activations carry {len(h.scales) // 2} scales for {groups} groups of {GROUP}"
        )
    k = h.outliers_per_row
    if k > cols or len(h.outliers) != 4 * k * h.rows:
        raise WireError(
            f"int8 activations carry {len(h.outliers)} outlier bytes for {h.rows} rows of {k}"
        )
    q = np.frombuffer(h.data, np.int8).reshape(h.rows, cols // GROUP, GROUP).astype(np.float32)
    scale = np.frombuffer(h.scales, "<f2").reshape(h.rows, cols // GROUP).astype(np.float32)
    apart = np.frombuffer(h.outliers, [("col", "<u2"), ("value", "<f2")]).reshape(h.rows, k)
    if not np.isfinite(scale).all() or not np.isfinite(apart["value"]).all():
        raise WireError("int8 activations carry a non-finite scale or outlier")
    if k and int(apart["col"].max()) >= cols:
        raise WireError(f"an int8 outlier names column {int(apart['col'].max())} of {cols}")
    out: np.ndarray = (q * scale[..., None]).reshape(h.rows, cols)
    np.put_along_axis(out, apart["col"].astype(np.int64), apart["value"].astype(np.float32), 1)
    return out


def rows_to_items(rows: Sequence[pb.Row], pool_blocks: int, ctx: int) -> list[BatchItem]:
    """A step's rows as the backend's batch items (token ids are not needed past the
    embedding: zeros), checked against the pool and the context so that no row reaches
    outside what this part allocated."""
    items = []
    for r in rows:
        if r.n_tokens < 1:
            raise WireError("a row with no tokens")
        if r.start + r.n_tokens > ctx:
            raise WireError(f"a row reaches position {r.start + r.n_tokens}, past the context")
        table = list(r.table)
        if any(b >= pool_blocks for b in table):
            raise WireError(f"a block table names a block outside the pool of {pool_blocks}")
        items.append(BatchItem([0] * r.n_tokens, r.start, table))
    if not items:
        raise WireError("a step with no rows")
    return items


def items_to_rows(items: Sequence[BatchItem]) -> list[pb.Row]:
    return [pb.Row(n_tokens=len(i.tokens), start=i.start, table=list(i.table)) for i in items]


_RANGE = re.compile(r"(\d{1,9}):(\d{1,9})")  # bounded: linear even under search


def parse_layers(text: str) -> tuple[int, int]:
    """`A:B` (layers A..B-1) as (A, B); ConfigError with the expected form otherwise."""
    m = _RANGE.fullmatch(text.strip())
    if m is None or int(m[1]) > int(m[2]):
        raise ConfigError(f"layers {text!r}: expected FIRST:END with FIRST <= END, e.g. 0:15")
    return int(m[1]), int(m[2])


def parse_part(text: str) -> tuple[int, int]:
    """`I/N` (part I of an N-part pipeline; the head is part 0, so a stage's I >= 1) as
    (I, N); ConfigError with the expected form otherwise."""
    i, sep, n = text.partition("/")
    if not (sep and i.isdigit() and n.isdigit() and 1 <= int(i) < int(n)):
        raise ConfigError(f"part {text!r}: expected I/N with 1 <= I < N (the head is 0)")
    return int(i), int(n)


def check_tiling(n_layers: int, parts: Sequence[tuple[str, tuple[int, int]]]) -> None:
    """The parts' ranges, in pipeline order, must cover [0, n_layers) exactly once, in
    order; ConfigError names the first gap or overlap and the parts around it."""
    at, prev = 0, "the start of the model"
    for name, (first, end) in parts:
        if first > at:
            raise ConfigError(
                f"layers {at}:{first} are served by nobody (a gap between "
                f"{prev} and {name} {first}:{end})"
            )
        if first < at:
            raise ConfigError(
                f"layers {first}:{min(at, end)} are served twice ({prev} and "
                f"{name} {first}:{end} overlap)"
            )
        if end <= first and name != "the head":
            raise ConfigError(f"{name} serves no layers ({first}:{end})")
        at, prev = end, f"{name} {first}:{end}"
    if at != n_layers:
        raise ConfigError(
            f"layers {at}:{n_layers} are served by nobody (the model has "
            f"{n_layers} layers; the last part, {prev}, ends at {at})"
        )


def layer_bytes(gguf: GGUFFile, n_layers: int) -> tuple[list[int], int]:
    """Bytes of each layer's tensors in the file, and of the rest (embedding, final norm,
    LM head: what the head holds besides its layers)."""
    per = [0] * n_layers
    rest = 0
    for t in gguf.tensors.values():
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers:
            per[int(parts[1])] += t.n_bytes
        else:
            rest += t.n_bytes
    return per, rest


def balanced_split(gguf: GGUFFile, n_layers: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges for `parts` processes (the head first, with the embedding and
    LM head) whose largest holds the fewest weight bytes: what `cgn-infer stage --part I/N`
    serves. Every part but the head gets at least one layer; deterministic, so every
    process of a pipeline computes the same split from the same file."""
    if not 2 <= parts <= n_layers + 1:
        raise ConfigError(
            f"a pipeline of {parts} parts over {n_layers} layers: expected 2 to "
            f"{n_layers + 1} parts"
        )
    per, rest = layer_bytes(gguf, n_layers)
    prefix = [0]
    for b in per:
        prefix.append(prefix[-1] + b)
    inf = float("inf")
    # best[k][j]: the smallest largest part when parts k.. (k >= 1) cover layers j..n
    best = [[inf] * (n_layers + 1) for _ in range(parts + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(parts + 1)]
    best[parts][n_layers] = 0
    for k in range(parts - 1, 0, -1):
        for j in range(n_layers):
            for e in range(j + 1, n_layers + 1):
                worst = max(prefix[e] - prefix[j], best[k + 1][e])
                if worst < best[k][j]:
                    best[k][j], cut[k][j] = worst, e
    first = min(range(n_layers), key=lambda j: (max(rest + prefix[j], best[1][j]), -j))
    bounds, at = [(0, first)], first
    for k in range(1, parts):
        bounds.append((at, cut[k][at]))
        at = cut[k][at]
    return bounds


def fingerprint(gguf: GGUFFile) -> str:
    """Which model file this is, cheaply: every tensor's name, type, shape and offset plus
    the file's size (two parts must load the same weights, not only the same shapes)."""
    h = hashlib.sha256(str(gguf.path.stat().st_size).encode())
    for t in sorted(gguf.tensors.values(), key=lambda t: t.name):
        h.update(f"{t.name}:{t.ggml_type}:{t.shape}:{t.offset};".encode())
    return h.hexdigest()[:32]
