"""Decoding: what `model.generate` would do for each prompt alone, applied to every live stream.

`options` is the call's configuration (generate's options and hf_parallel's own), `generate_args`
has generate itself prepare each prompt's processors and criteria, `logits` runs them over all live
streams, `sampling` picks each stream's token, and `inputs` checks what users hand in.
"""
