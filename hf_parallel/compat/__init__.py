"""Every place hf_parallel relies on the internals of transformers or lm-eval, each one a named function.

    transformers_internals  private attributes, module layouts and behaviours of transformers that no public API
                            states (torch and transformers imported)
    transformers_names      what the names of transformers' classes say (nothing imported)
    lm_eval_internals       lm-eval's HFLM methods that are not its public API (lm-eval not imported: it is
                            handed lm-eval's objects)
    method_on_import        `model.generate_parallel`, added once transformers defines `PreTrainedModel` (no
                            import of torch or transformers: `import hf_parallel` stays light)

Each function's docstring says what it relies on and in which versions that was checked; tests/test_compat.py
checks each on a tiny random-weight model, and that no other module of hf_parallel touches these internals.
This package imports nothing else of hf_parallel, and importing it imports none of its modules.
"""
