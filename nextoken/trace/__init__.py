"""The tracer: one request through the real engine, on the paths an untraced one takes, watched through the model's
probe (the native calls' own counters; hooks where the torch modules run) and a wrapped sampler call.

Module map: `tracer` (NullTracer, RecordingTracer: spans per step, per-layer times, sampled distributions),
`passes` (each step's forward pass as the probe reports it), `replay` (a fused step re-run on the modules),
`attention` (weights recomputed from captured post-RoPE q and k), `probs` (raw vs sampled distribution per step),
`run` (drives one request: tokenize, add_request, step until finished), `cost` (FLOPs and bytes from ModelConfig,
machine peaks), `summary` (the figures a report shows), `report` (terminal, rich), `html` (one self-contained page),
`command` (`nextoken trace`). Nothing here is imported by the engine: an untraced run never loads it.
"""
