"""The layer pipeline (proto/cognitora/v1/pipeline.proto; docs/cgn-infer.md, "Layer
pipeline"): `wire` (activations and layer ranges), `stage` (`cgn-infer stage`), `head`
(the backend `cgn-infer serve --stages` runs)."""
