"""Engine drivers: argv against each engine's documented flags, validation before launch, KV connectors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from cgn_agent.drivers import DRIVERS, LaunchContext, PlacementRefused, installed_engines
from cgn_agent.inventory.types import Accelerator, Cpu, Inventory
from cgn_agent.launchers import mlx_lm_server
from cgn_agent.spec import (
    EngineProfile,
    LoraFile,
    PipelinePart,
    ReplicaId,
    ReplicaSpec,
)
from cgn_core.cli import load_service_settings, parse_overrides
from cgn_core.settings import TlsSettings, check_ranges, load_settings
from cgn_infer.settings import InferSettings

BIN = Path(sys.executable).parent
CTX = LaunchContext("0.0.0.0", 8100, python="/venv/bin/python")

# Flags as each engine documents them (vLLM `vllm serve --help`, SGLang server
# arguments, `trtllm-serve --help`, mlx_lm.server, llama.cpp's server README,
# llama-cpp-python's server settings).
DOCUMENTED = {
    "vllm": {"--host", "--port", "--served-model-name", "--tensor-parallel-size",
             "--max-model-len", "--dtype", "--gpu-memory-utilization", "--kv-transfer-config",
             "--kv-offloading-backend", "--kv-offloading-size", "--enable-lora", "--max-loras",
             "--max-lora-rank", "--lora-modules"},
    "sglang": {"--model-path", "--host", "--port", "--served-model-name", "--tp-size",
               "--context-length", "--dtype", "--mem-fraction-static", "--enable-metrics",
               "--enable-hierarchical-cache", "--enable-lmcache", "--disaggregation-mode",
               "--disaggregation-transfer-backend", "--hicache-size", "--enable-lora",
               "--max-loras-per-batch", "--max-loaded-loras", "--max-lora-rank", "--lora-paths"},
    "trtllm": {"--host", "--port", "--backend", "--tp_size", "--max_seq_len", "--served_model_name"},
    "mlx_lm": {"--source", "--name", "--host", "--port"},  # cgn_agent/launchers/mlx_lm_server.py
    "llama_server": {"-m", "--host", "--port", "--alias", "--metrics", "-c", "-t", "-ngl",
                     "--lora", "--lora-init-without-apply"},
    "llama_cpp_python": {"--model", "--host", "--port", "--model_alias", "--n_ctx",
                         "--n_threads", "--n_gpu_layers"},
}  # fmt: skip


@dataclass
class FakeTools:
    binaries: dict[str, str] = field(default_factory=dict)
    modules: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)

    def which(self, name: str) -> str | None:
        return self.binaries.get(name)

    def has_module(self, name: str) -> bool:
        return name in self.modules

    def is_file(self, path: str) -> bool:
        return path in self.files


def h100s(n: int, sick: int | None = None) -> Inventory:
    gpus = tuple(
        Accelerator("nvidia", i, "NVIDIA H100 80GB HBM3", "h100-80g", 81559,
                    health=("uncorrected ECC errors: 2",) if i == sick else ())
        for i in range(n)
    )  # fmt: skip
    return Inventory("g1", "g1", Cpu("x", 64, 1 << 20), gpus)


CPU_NODE = Inventory("c1", "c1", Cpu("x", 2, 24000))
MAC = Inventory(
    "m1", "m1", Cpu("Apple M2 Ultra", 24, 196608),
    (Accelerator("apple", 0, "Apple M2 Ultra", "m2-ultra-192g", 196608),),
)  # fmt: skip
ALL_TOOLS = FakeTools(
    {"vllm": "/v/bin/vllm", "trtllm-serve": "/t/bin/trtllm-serve", "llama-server": "/usr/bin/llama-server",
     "cgn-infer": "/venv/bin/cgn-infer"},
    {"sglang", "mlx_lm", "xllamacpp", "llama_cpp"},
    {"/m/smol.gguf"},
)  # fmt: skip


def spec(engine: str, **kw: object) -> ReplicaSpec:
    profile = kw.pop("profile", EngineProfile())
    base = ReplicaSpec(ReplicaId("r1"), "llama-8b", engine, "meta-llama/Llama-3.1-8B-Instruct")
    return replace(base, profile=profile, **kw)  # type: ignore[arg-type]


def flags(argv: tuple[str, ...]) -> set[str]:
    return {a for a in argv if re.match(r"^--?[a-zA-Z]", a) and not a.startswith("-1")}


def test_vllm_argv_env_and_documented_flags() -> None:
    s = spec("vllm", devices=(2, 3), profile=EngineProfile(ctx=8192, tensor_parallel=2,
             gpu_memory_utilization=0.9, kv_connector="lmcache", extra_args=("--enable-prefix-caching",)))  # fmt: skip
    DRIVERS["vllm"].validate(s, h100s(4), ALL_TOOLS)
    launch = DRIVERS["vllm"].launch(s, CTX, ALL_TOOLS)
    assert launch.argv == (
        "/v/bin/vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--host", "0.0.0.0",
        "--port", "8100", "--served-model-name", "llama-8b", "--tensor-parallel-size", "2",
        "--max-model-len", "8192", "--gpu-memory-utilization", "0.9", "--kv-transfer-config",
        '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}', "--enable-prefix-caching",
    )  # fmt: skip
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert launch.url == "http://127.0.0.1:8100" and launch.metrics_dialect == "vllm"
    assert flags(launch.argv[:-1]) <= DOCUMENTED["vllm"]


def test_vllm_and_sglang_serve_the_models_peft_adapters() -> None:
    """#60: the PEFT directories the reconciler lists, by name, the batch's adapter slots,
    the largest rank; vLLM may load more at run time (its environment switch)."""
    peft = (LoraFile("sql", "/m/sql"), LoraFile("fr", "/m/fr"))
    profile = EngineProfile(lora=peft, max_loras=4, max_lora_rank=16)
    v = DRIVERS["vllm"].launch(spec("vllm", devices=(0,), profile=profile), CTX, ALL_TOOLS)
    assert v.argv[-8:] == ("--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
                           "--lora-modules", "sql=/m/sql", "fr=/m/fr")  # fmt: skip
    assert v.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert flags(v.argv) <= DOCUMENTED["vllm"]
    g = DRIVERS["sglang"].launch(spec("sglang", devices=(0,), profile=profile), CTX, ALL_TOOLS)
    assert g.argv[-10:] == ("--enable-lora", "--max-loras-per-batch", "4", "--max-loaded-loras",
                            "4", "--max-lora-rank", "16", "--lora-paths", "sql=/m/sql",
                            "fr=/m/fr")  # fmt: skip
    assert flags(g.argv[3:]) <= DOCUMENTED["sglang"]
    plain = DRIVERS["vllm"].launch(spec("vllm", devices=(0,)), CTX, ALL_TOOLS)
    assert "--enable-lora" not in plain.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env


def test_sglang_argv_and_documented_flags() -> None:
    s = spec("sglang", devices=(0,), profile=EngineProfile(ctx=4096, kv_connector="hicache", dtype="bfloat16",
             gpu_memory_utilization=0.85))  # fmt: skip
    DRIVERS["sglang"].validate(s, h100s(1), ALL_TOOLS)
    launch = DRIVERS["sglang"].launch(s, CTX, ALL_TOOLS)
    assert launch.argv == (
        "/venv/bin/python", "-m", "sglang.launch_server", "--model-path",
        "meta-llama/Llama-3.1-8B-Instruct", "--host", "0.0.0.0", "--port", "8100",
        "--served-model-name", "llama-8b", "--tp-size", "1", "--context-length", "4096",
        "--dtype", "bfloat16", "--mem-fraction-static", "0.85", "--enable-metrics",
        "--enable-hierarchical-cache",
    )  # fmt: skip
    assert flags(launch.argv[3:]) <= DOCUMENTED["sglang"] and launch.metrics_dialect == "sglang"


def test_trtllm_and_mlx_argv_and_documented_flags() -> None:
    s = spec("trtllm", devices=(0, 1), profile=EngineProfile(tensor_parallel=2, ctx=16384))
    DRIVERS["trtllm"].validate(s, h100s(2), ALL_TOOLS)
    launch = DRIVERS["trtllm"].launch(s, CTX, ALL_TOOLS)
    assert launch.argv == (
        "/t/bin/trtllm-serve", "meta-llama/Llama-3.1-8B-Instruct", "--host", "0.0.0.0",
        "--port", "8100", "--backend", "pytorch", "--tp_size", "2", "--max_seq_len", "16384",
        "--served_model_name", "llama-8b",
    )  # fmt: skip
    assert flags(launch.argv) <= DOCUMENTED["trtllm"]
    assert launch.metrics_dialect is None  # its /metrics is JSON, not Prometheus
    m = spec("mlx_lm", model="qwen-7b", source="mlx-community/Qwen2.5-7B-4bit")
    m = replace(m, profile=EngineProfile(extra_args=("--temp", "0.2")))
    DRIVERS["mlx_lm"].validate(m, MAC, ALL_TOOLS)
    DRIVERS["mlx_lm"].validate(m, CPU_NODE, ALL_TOOLS)  # MLX's CPU backend: any node with mlx_lm
    launch = DRIVERS["mlx_lm"].launch(m, replace(CTX, token="s3cret"), ALL_TOOLS)
    assert launch.argv == ("/venv/bin/python", "-m", "cgn_agent.launchers.mlx_lm_server", "--source",
                           "mlx-community/Qwen2.5-7B-4bit", "--name", "qwen-7b", "--host", "0.0.0.0",
                           "--port", "8100", "--", "--temp", "0.2")  # fmt: skip
    assert flags(launch.argv[3:-3]) <= DOCUMENTED["mlx_lm"]
    assert launch.env == {"MLX_LM_API_KEY": "s3cret"} and launch.token == "s3cret"
    assert launch.metrics_dialect == "mlx_lm"
    parsed = mlx_lm_server.parser().parse_args(launch.argv[3:])  # the runner takes its argv
    assert (parsed.source, parsed.name, parsed.port, parsed.rest) == (
        "mlx-community/Qwen2.5-7B-4bit", "qwen-7b", 8100, ["--temp", "0.2"])  # fmt: skip


def test_llama_cpp_loads_a_bundled_model_by_its_name() -> None:
    """configs/models/smollm2.yaml's llama_cpp profile: source `smollm2` is the bundled file."""
    from cgn_core.bundled_models import smollm2

    s = spec("llama_cpp", source="smollm2")
    tools = replace(ALL_TOOLS, files={str(smollm2())})
    DRIVERS["llama_cpp"].validate(s, CPU_NODE, tools)
    assert str(smollm2()) in DRIVERS["llama_cpp"].launch(s, CTX, tools).argv


@pytest.mark.parametrize(
    ("launcher", "documented", "program", "health", "dialect"),
    [
        ("auto", "llama_server", 1, "/health", "llamacpp"),
        ("llama_server", "llama_server", 1, "/health", "llamacpp"),
        ("llama_cpp_python", "llama_cpp_python", 3, "/v1/models", None),
    ],
)
def test_llama_cpp_launchers(launcher: str, documented: str, program: int, health: str,
                             dialect: str | None) -> None:  # fmt: skip
    s = replace(spec("llama_cpp", source="/m/smol.gguf", profile=EngineProfile(ctx=2048, threads=4,
                launcher=launcher)), model="smol")  # fmt: skip
    DRIVERS["llama_cpp"].validate(s, CPU_NODE, ALL_TOOLS)
    launch = DRIVERS["llama_cpp"].launch(s, CTX, ALL_TOOLS)
    assert flags(launch.argv[program:]) <= DOCUMENTED[documented]
    assert launch.health_path == health and launch.metrics_dialect == dialect
    assert "smol" in launch.argv and "/m/smol.gguf" in launch.argv


def test_llama_cpp_loads_the_models_adapters_at_start_and_applies_none() -> None:
    """A model's LoRA adapters (the reconciler lists them in name order: a request's `lora`
    id is the index) load at start at scale 0; a launcher that cannot load them, or a
    missing file, is a refusal before anything starts."""
    lora = (LoraFile("fr", "/m/fr.gguf"), LoraFile("sql", "/m/sql.gguf"))
    s = replace(spec("llama_cpp", source="/m/smol.gguf",
                     profile=EngineProfile(launcher="llama_server", lora=lora)), model="smol")  # fmt: skip
    tools = replace(ALL_TOOLS, files={"/m/smol.gguf", *(f.path for f in lora)})
    DRIVERS["llama_cpp"].validate(s, CPU_NODE, tools)
    argv = DRIVERS["llama_cpp"].launch(s, CTX, tools).argv
    assert argv[-5:] == (
        "--lora",
        "/m/fr.gguf",
        "--lora",
        "/m/sql.gguf",
        "--lora-init-without-apply",
    )
    assert flags(argv[1:]) <= DOCUMENTED["llama_server"]
    with pytest.raises(PlacementRefused, match=r"LoRA adapter sql \(/m/sql\.gguf\) does not exist"):
        DRIVERS["llama_cpp"].validate(
            s, CPU_NODE, replace(tools, files={"/m/smol.gguf", lora[0].path})
        )
    python = replace(s, profile=replace(s.profile, launcher="llama_cpp_python"))
    with pytest.raises(PlacementRefused, match="llama_cpp_python launcher loads no LoRA"):
        DRIVERS["llama_cpp"].validate(python, CPU_NODE, tools)


def _help_flags(argv: list[str]) -> set[str]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out.stdout))


def test_cgn_infer_and_xllamacpp_argv_use_flags_their_real_help_lists() -> None:
    """The two engines installed here: their own --help is the documentation."""
    tools = FakeTools({"cgn-infer": str(BIN / "cgn-infer")}, {"xllamacpp"}, {"/m/smol.gguf"})
    s = replace(spec("cgn_infer", source="/m/smol.gguf",
                     profile=EngineProfile(ctx=2048, threads=2, backend="sim", dtype="int8")), model="smol")  # fmt: skip
    DRIVERS["cgn_infer"].validate(s, CPU_NODE, tools)
    ctx = replace(CTX, kvcached="127.0.0.1:7071", kvcached_token="kvtok")
    launch = DRIVERS["cgn_infer"].launch(s, ctx, tools)
    assert launch.argv[:2] == (str(BIN / "cgn-infer"), "serve")
    assert launch.argv[launch.argv.index("--kvcached") + 1] == "127.0.0.1:7071"
    assert launch.env["CGN_INFER_KVCACHED__TOKEN"] == "kvtok" and "kvtok" not in launch.argv
    assert flags(launch.argv) <= _help_flags([str(BIN / "cgn-infer"), "serve", "--help"])
    assert launch.metrics_dialect == "cgn-infer"
    sql = (LoraFile("sql", "/m/sql.gguf"),)
    adapted = replace(s, profile=EngineProfile(lora=sql))
    DRIVERS["cgn_infer"].validate(
        adapted, CPU_NODE, replace(tools, files={"/m/smol.gguf", "/m/sql.gguf"})
    )
    argv = DRIVERS["cgn_infer"].launch(adapted, ctx, tools).argv
    assert argv[argv.index("--lora") + 1] == "sql=/m/sql.gguf" and "max_loras=3" not in argv
    slots = replace(adapted, profile=EngineProfile(lora=sql, max_loras=3))
    argv = DRIVERS["cgn_infer"].launch(slots, replace(ctx, model_dirs=("/m", "/n")), tools).argv
    assert "max_loras=3" in argv and "lora_dirs=/m,/n" in argv  # the rest at run time
    assert flags(argv) <= _help_flags([str(BIN / "cgn-infer"), "serve", "--help"])
    for bad, why in (
        (adapted, "does not exist"),
        (replace(adapted, profile=EngineProfile(lora=sql, backend="sim")), "torch backend"),
    ):
        with pytest.raises(PlacementRefused, match=why):
            DRIVERS["cgn_infer"].validate(bad, CPU_NODE, tools)
    x = replace(spec("llama_cpp", source="/m/smol.gguf",
                     profile=EngineProfile(ctx=2048, threads=2, launcher="xllamacpp",
                                           lora=(LoraFile("sql", "/m/sql.gguf"),))), model="smol", devices=())  # fmt: skip
    launch = DRIVERS["llama_cpp"].launch(x, CTX, tools)
    assert launch.argv[1:3] == ("-m", "cgn_agent.launchers.xllamacpp_server")
    assert launch.argv[-3:] == ("--lora", "/m/sql.gguf", "--lora-init-without-apply")
    helped = _help_flags([sys.executable, "-m", "cgn_agent.launchers.xllamacpp_server", "--help"])
    assert flags(launch.argv[3:]) <= helped


def test_cgn_infer_roles_and_the_transfer_address_reach_the_engine() -> None:
    """A prefill (or both) engine serves its KV on the engines' bind address and tells decode
    engines the node's advertised one; a decode engine serves none. The settings parse."""
    tools = FakeTools({"cgn-infer": "/bin/cgn-infer"}, set(), {"/m/smol.gguf"})
    ctx = replace(CTX, advertise_host="10.0.0.2")
    sets: dict[str, list[str]] = {}
    for role in ("prefill", "decode", "both"):
        s = replace(spec("cgn_infer", source="/m/smol.gguf", role=role), model="smol")
        argv = DRIVERS["cgn_infer"].launch(s, ctx, tools).argv
        assert ("--role" in argv) == (role != "both")
        if role != "both":
            assert argv[argv.index("--role") + 1] == role
        sets[role] = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert (
        sets["prefill"] == sets["both"] == ["transfer.host=0.0.0.0", "transfer.advertise=10.0.0.2"]
    )
    assert sets["decode"] == []
    settings = load_service_settings(InferSettings, "infer", None, parse_overrides(sets["prefill"]))
    assert (settings.transfer.host, settings.transfer.advertise) == ("0.0.0.0", "10.0.0.2")


@pytest.mark.parametrize(
    ("engine", "node", "kw", "message"),
    [
        ("vllm", CPU_NODE, {}, "vllm needs an NVIDIA GPU; node c1 is class cpu"),
        ("sglang", MAC, {"devices": (0,)}, "sglang needs an NVIDIA GPU; node m1 is class m2-ultra-192g"),
        ("trtllm", h100s(8), {"devices": (0,), "profile": EngineProfile(tensor_parallel=2)},
         "tensor_parallel=2 needs 2 device"),
        ("vllm", h100s(2), {"devices": (5,)}, "device 5 does not exist on node g1"),
        ("vllm", h100s(4, sick=3), {"devices": (3,)}, "device 3 is unhealthy (uncorrected ECC errors: 2)"),
        ("vllm", h100s(1), {"devices": (0,), "profile": EngineProfile(kv_connector="hicache")},
         "vllm has no 'hicache' KV connector"),
        ("sglang", h100s(1), {"devices": (0,), "profile": EngineProfile(kv_connector="kvbm")},
         "sglang has no 'kvbm' KV connector"),
        ("sglang", h100s(1), {"devices": (0,), "profile": EngineProfile(kv_connector="nixl")},
         "nixl needs role prefill or decode"),
        ("mlx_lm", CPU_NODE, {"source": "/missing.gguf"}, "model file /missing.gguf does not exist"),
        ("mlx_lm", MAC, {"devices": (0,)}, "mlx_lm takes no device indices"),
        ("llama_cpp", CPU_NODE, {"source": "/missing.gguf"}, "model file /missing.gguf does not exist"),
        ("llama_cpp", CPU_NODE, {"source": "/m/smol.gguf", "profile": EngineProfile(kv_connector="lmcache")},
         "llama_cpp has no engine-side KV connector"),
        ("cgn_infer", CPU_NODE, {"source": "/m/smol.gguf", "profile": EngineProfile(backend="tpu")},
         "backend must be one of torch, mlx, sim"),
        ("cgn_infer", CPU_NODE, {"source": ""}, "placement has no 'source'"),
        ("openai_compat", CPU_NODE, {}, "profile.url must be the engine's http(s) URL"),
    ],
)  # fmt: skip
def test_validation_refuses_what_the_node_cannot_run(
    engine: str, node: Inventory, kw: dict[str, object], message: str
) -> None:
    with pytest.raises(PlacementRefused, match=re.escape(message)):
        DRIVERS[engine].validate(spec(engine, **kw), node, ALL_TOOLS)


@pytest.mark.parametrize(
    ("connector", "role", "args"),
    [
        ("none", "both", []),
        ("nixl", "both", ["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}']),
        ("kvbm", "both", ["--kv-transfer-config", json.dumps({"kv_connector": "DynamoConnector",
         "kv_connector_module_path": "kvbm.vllm_integration.connector", "kv_role": "kv_both"},
         separators=(",", ":"))]),
    ],
)  # fmt: skip
def test_vllm_kv_connector_matrix(connector: str, role: str, args: list[str]) -> None:
    s = spec("vllm", devices=(0,), role=role, profile=EngineProfile(kv_connector=connector))  # type: ignore[arg-type]
    argv = DRIVERS["vllm"].launch(s, CTX, ALL_TOOLS).argv
    assert list(argv[argv.index("1") + 1 :]) == args


@pytest.mark.parametrize(
    ("connector", "role", "args"),
    [
        ("lmcache", "both", ["--enable-lmcache"]),
        ("nixl", "prefill", ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "nixl"]),
        ("nixl", "decode", ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl"]),
    ],
)  # fmt: skip
def test_sglang_kv_connector_matrix(connector: str, role: str, args: list[str]) -> None:
    s = spec("sglang", devices=(0,), role=role, profile=EngineProfile(kv_connector=connector))  # type: ignore[arg-type]
    argv = DRIVERS["sglang"].launch(s, CTX, ALL_TOOLS).argv
    assert list(argv[argv.index("--enable-metrics") + 1 :]) == args


def test_installed_engines_and_openai_compat() -> None:
    assert installed_engines(FakeTools()) == ["openai_compat"]
    assert installed_engines(ALL_TOOLS) == list(DRIVERS)
    s = spec("openai_compat", profile=EngineProfile(url="http://10.0.0.9:8000/"))
    DRIVERS["openai_compat"].validate(s, CPU_NODE, FakeTools())
    launch = DRIVERS["openai_compat"].launch(s, CTX, FakeTools())
    assert not launch.spawn and launch.url == "http://10.0.0.9:8000" and launch.argv == ()


def test_a_pipeline_head_gets_its_stages_and_a_stage_its_part_and_head() -> None:
    """A multi-node cgn-infer replica: the stage runs `cgn-infer stage --part I/N`, serves
    only the head's certificate, is probed by TCP and never published to routers; the head
    is `serve --stages`. Both argv use flags the real --help lists."""
    tools = FakeTools({"cgn-infer": str(BIN / "cgn-infer")}, set(), {"/m/smol.gguf"})
    base = replace(spec("cgn_infer", source="/m/smol.gguf",
                        profile=EngineProfile(threads=1, extra_args=("--max-batch", "4"))),
                   model="smol")  # fmt: skip
    tls = TlsSettings(Path("/pki/ca.pem"), Path("/pki/n2.pem"), Path("/pki/n2.key"))
    stage = replace(base, pipeline=PipelinePart(1, 2, "n1"))
    DRIVERS["cgn_infer"].validate(stage, CPU_NODE, tools)
    launch = DRIVERS["cgn_infer"].launch(stage, replace(CTX, tls=tls), tools)
    argv = launch.argv
    assert argv[1:5] == ("stage", "--model", "/m/smol.gguf", "--part") and argv[5] == "1/2"
    assert argv[argv.index("--head") + 1] == "n1" and "--max-batch" not in argv
    assert (launch.probe, launch.endpoint, launch.url) == ("tcp", False, "tcp://0.0.0.0:8100")
    assert flags(argv) <= _help_flags([str(BIN / "cgn-infer"), "stage", "--help"])
    head = replace(base, pipeline=PipelinePart(0, 2, "n1", ("10.0.0.2:9101",)))
    DRIVERS["cgn_infer"].validate(head, CPU_NODE, tools)
    launch = DRIVERS["cgn_infer"].launch(head, CTX, tools)
    assert launch.argv[launch.argv.index("--stages") + 1] == "10.0.0.2:9101"
    assert launch.probe == "http" and launch.endpoint and "--max-batch" in launch.argv
    assert flags(launch.argv) <= _help_flags([str(BIN / "cgn-infer"), "serve", "--help"])
    for bad, why in [
        (replace(head, pipeline=PipelinePart(0, 2, "n1")), "needs its stages"),
        (replace(stage, profile=EngineProfile(backend="sim")), "torch or mlx, not sim"),
        (replace(stage, role="decode"), "serves role both"),
    ]:
        with pytest.raises(PlacementRefused, match=why):
            DRIVERS["cgn_infer"].validate(bad, CPU_NODE, tools)


@pytest.mark.parametrize(
    ("engine", "launcher", "variable"),
    [("cgn_infer", "auto", "CGN_INFER_API_TOKEN"), ("vllm", "auto", "VLLM_API_KEY"),
     ("llama_cpp", "llama_server", "LLAMA_API_KEY"), ("llama_cpp", "xllamacpp", "LLAMA_API_KEY")],
)  # fmt: skip
def test_engines_that_can_require_a_secret_get_it_in_their_environment(
    engine: str, launcher: str, variable: str
) -> None:
    spec = ReplicaSpec(ReplicaId("r1"), "m", engine, "/m/x.gguf", devices=(),
                       profile=EngineProfile(launcher=launcher))  # fmt: skip
    tools = FakeTools(binaries={b: f"/usr/bin/{b}" for b in ("vllm", "llama-server", "cgn-infer")})
    launch = DRIVERS[engine].launch(spec, LaunchContext("127.0.0.1", 8001, token="s3cret"), tools)
    assert launch.env[variable] == "s3cret" and launch.token == "s3cret"
    assert not any("s3cret" in a for a in launch.argv)  # never on the command line (ps)
    bare = DRIVERS[engine].launch(spec, LaunchContext("127.0.0.1", 8001), tools)
    assert variable not in bare.env and bare.token == ""


@pytest.mark.parametrize(
    ("engine", "connector", "gib", "args"),
    [
        ("vllm", "none", 8.0, ["--kv-offloading-backend", "native", "--kv-offloading-size", "8"]),
        ("vllm", "none", 0.0, []),
        ("vllm", "lmcache", 8.0, []),  # its own connector owns offloading
        ("sglang", "none", 16.0, ["--enable-hierarchical-cache", "--hicache-size", "16"]),
        ("sglang", "hicache", 16.0, []),
        ("trtllm", "none", 8.0, []),
    ],
)  # fmt: skip
def test_node_store_gives_gpu_engines_their_builtin_offload(
    engine: str, connector: str, gib: float, args: list[str]
) -> None:
    from cgn_agent.drivers.kv_connectors import offload_args

    assert offload_args(engine, connector, gib) == args  # type: ignore[arg-type]
    if engine == "vllm" and args:
        launch = DRIVERS["vllm"].launch(
            spec("vllm", devices=(0,)), replace(CTX, offload_gib=gib), ALL_TOOLS
        )
        assert launch.argv[-4:] == tuple(args) and flags(launch.argv) <= DOCUMENTED["vllm"]


def test_node_store_plan_and_settings(tmp_path: Path) -> None:
    from cgn_agent import kvcached
    from cgn_agent.settings import AgentSettings, NodeKvcachedSettings
    from cgn_core.errors import ConfigError
    from cgn_core.kv.identity import StoreKeys, read_secret

    off = kvcached.plan(NodeKvcachedSettings(), "10.0.0.5", "t")
    assert off.address == "" and off.record is None
    run = NodeKvcachedSettings(mode="run", port=7100, admin_port=9100, engine_offload_gib=4)
    got = kvcached.plan(run, "10.0.0.5", "tok")
    assert got.address == "127.0.0.1:7100" and got.offload_gib == 4  # engines: same node
    assert got.record == {"address": "127.0.0.1:7100", "events_token": "tok",
                          "events_url": "http://10.0.0.5:9100/v1/kv/events"}  # fmt: skip
    argv = kvcached.argv(run, "/bin/cgn-kvcached", "10.0.0.5", Path("/r"), None)
    assert "admin.host=10.0.0.5" in argv  # the events: for routers on other machines
    assert argv[:6] == ["/bin/cgn-kvcached", "serve", "--host", "127.0.0.1", "--port", "7100"]
    assert "--ssd-dir" not in argv
    # the node secret: made once (0600), the store reads it, engines get only the client token
    secret = kvcached.secret_path(run, tmp_path)
    assert secret == tmp_path / "kvcached.secret"
    got = kvcached.plan(run, "10.0.0.5", "tok", secret)
    assert secret.stat().st_mode & 0o777 == 0o600
    assert got.client_token == StoreKeys.derive(read_secret(secret)).client_token
    assert kvcached.plan(run, "10.0.0.5", "tok", secret).client_token == got.client_token
    with_secret = kvcached.argv(run, "/bin/cgn-kvcached", "h", Path("/r"), None, secret)
    assert f"secret_file={secret}" in with_secret
    assert got.client_token not in " ".join(with_secret)  # argv is world-readable
    external = replace(run, mode="external", secret_file=tmp_path / "missing")
    assert kvcached.secret_path(external, tmp_path) == tmp_path / "missing"
    with pytest.raises(ConfigError, match=r"secret_file .*missing"):  # not made for a unit
        kvcached.plan(external, "10.0.0.5", "tok", tmp_path / "missing")
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0600"):
        kvcached.plan(run, "10.0.0.5", "tok", secret)
    helped = _help_flags([str(BIN / "cgn-kvcached"), "serve", "--help"])
    assert flags(tuple(argv)) <= helped
    for bad, why in ((replace(run, port=0), r"port must be in \[1, 65535\]"),
                     (replace(run, ssd_dir=Path("/kv")), "go together"),
                     (replace(run, engine_offload_gib=-1), "engine_offload_gib")):  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            check_ranges(bad)
            bad.check()
    # loaded as settings, the error names the path
    with pytest.raises(ConfigError, match=r"^kvcached\.port must be in \[1, 65535\]"):
        load_settings(AgentSettings, "agent", flags={"kvcached.mode": "run", "kvcached.port": "0"})


@pytest.mark.slow
def test_a_store_left_running_by_a_killed_agent_is_stopped_before_the_next(tmp_path: Path) -> None:
    """The next spawn finds the last one's fingerprint and stops that process group, and only
    a live process matching it (a record of a process long gone is left alone)."""
    import os

    from cgn_agent.kvcached import _spawn
    from cgn_core.process import stop_group

    ready, log = tmp_path / "kvcached.ready", tmp_path / "kvcached.log"
    first = _spawn(["sleep", "60"], dict(os.environ), ready, log)
    second = _spawn(["sleep", "60"], dict(os.environ), ready, log)
    try:
        assert first.wait(timeout=15) is not None  # stopped (SIGTERM) by the second spawn
        assert second.poll() is None
    finally:
        stop_group(second, grace_s=5)
    third = _spawn(["sleep", "60"], dict(os.environ), ready, log)  # the second is gone: no-op
    stop_group(third, grace_s=5)


def test_kv_transfer_directories_of_gone_engines_are_reclaimed(tmp_path: Path) -> None:
    """Named after their engine's pid: the agent removes those of an engine it saw exit, and
    at start those of every pid that is gone; never a live engine's, another user's, or
    anything through a link."""
    import os
    import subprocess

    from cgn_core.kv import shm

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f"cgn-kv-transfer-{gone.pid}-abc"
    live = shm.make_private(tmp_path)
    assert live is not None and live.name.startswith(f"cgn-kv-transfer-{os.getpid()}-")
    for d in (dead, tmp_path / "elsewhere"):
        d.mkdir()
        (d / "c1-x.kv").write_bytes(b"kv")
    (tmp_path / f"cgn-kv-transfer-{gone.pid}-link").symlink_to(tmp_path / "elsewhere")
    theirs = tmp_path / f"cgn-kv-transfer-{gone.pid}-theirs"
    theirs.mkdir()
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    removed = shm.reclaim(root=tmp_path)
    assert dead in removed and not dead.exists()
    assert theirs.exists() or os.geteuid() != 0  # as root it was given away: kept
    assert live.is_dir() and (tmp_path / "elsewhere" / "c1-x.kv").exists()
    assert shm.reclaim(os.getpid(), root=tmp_path) == [live]  # this "engine" exited
