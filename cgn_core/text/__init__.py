"""Text handling shared by the engine and the router: GGUF metadata, tokenizers, chat templates."""
