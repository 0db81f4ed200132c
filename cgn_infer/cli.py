"""cgn-infer command line (typer; see cgn_core.cli for the shared parts)."""

from cgn_core.cli import make_app, not_built, run
from cgn_infer.settings import InferSettings

app = make_app(
    "infer", "Cognitora's native engine: GGUF models behind the OpenAI API.", InferSettings
)
not_built(app, "serve", "serve a GGUF model over the OpenAI API", 3)

main = run(app)
