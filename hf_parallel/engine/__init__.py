"""The engine: one core loop over a packed row, and the calls that run it.

`core` is the loop (`EngineCore`): each round schedules (an admission policy, `policies`, places waiting
requests' streams; a chunk of prompt tokens and every decoding stream's newest token or draft are fed), runs one
forward of the model runner (`hf_parallel.runner`), lets each choice group choose or verify its streams' tokens
(`groups`, with drafts from `drafts`), and updates the streams a round late (`streams`: requests, streams and the
records the stages hand on).  `generate` is the call (`generate_tokens`, `stream_tokens`), `serving` the engine of
a server: requests joining a live row while it decodes.
"""
