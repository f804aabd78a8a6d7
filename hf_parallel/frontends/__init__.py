"""Front ends: text in and text out over the engine.

`prompting` renders prompts and answers questions about a document (`generate_parallel`), `scoring` and
`judging` score candidates in one packed forward, `corpus` answers many documents, `datasets` a
`datasets.Dataset`, `data_parallel` splits a corpus over processes, `session` keeps a row between calls,
`default_model` loads the embedded SmolLM2 and `demo` shows it.  `jsonlines` holds the resumable files.
"""
