"""The engine: one core loop over a packed row.

`core` is the loop (`EngineCore`): each round schedules (`scheduler`: an admission policy, `policies`, picks waiting
requests and the row's contents place them; a chunk of prompt tokens and every decoding stream's newest token or
draft are fed), runs one forward of the model runner (`hf_parallel.runner`), lets each group choose, verify or score
(`groups`, with drafts from `drafts`), and updates the streams a round late (`streams`: requests, streams and the
records the stages hand on).  `requests` is the one door every request is checked by, `stats` what a row's engine
did.  The calls that run it are front ends (`hf_parallel.frontends`: `generate`, `serving`, `scoring`, `probe`).
"""
