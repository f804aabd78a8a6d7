"""The packed row: where every token lives, what each forward may see, and the cache that holds it.

`layout` lays a fixed set of prompts out as a prefix tree of segments over slots, `prefix_tree` the resident
prompts of a row whose prompts come and go, `plan` is the per-forward metadata every layer reads, and
`cache` the `transformers.Cache` holding the row's keys and values (and recurrent states).
"""
