"""The model runner: one model's packed row and its forwards, below the engine's loop.

`model_runner` runs a forward of given tokens at given slots under the row's layout (`ModelRunner`), replaying
captured CUDA graphs where it can (`graphs`, over a `rows.StaticRow`, which a `rows.RowKeeper` may keep between
calls); `patching` sets a model up for a call and takes it back, `probe` decides whether the packed row can serve
a model (its `ModelProfile`), `sizing` how large a row a memory budget holds.
"""
