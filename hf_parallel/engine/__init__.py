"""The engine: one call from prompts to answers over one packed row.

`generate` is the call (`generate_tokens`, `stream_tokens`): it checks the inputs, probes the model
(`probe`), sizes the row (`budget`) and runs it, as one row (`runner`: prefill, then decode), or, past
one row's memory, as rounds that admit waiting prompts as room frees up (`refill`, `admission`).
`patching` sets the model up for the call and takes it back; `cuda_graphs` captures decode steps over a
`rows.StaticRow`, which a `rows.RowKeeper` may keep between calls.  `serving` is the engine of a
server: requests join a live row while it decodes (`live`), each admitted where it fits (`admission`).
"""
