"""Model adaptations: what hf_parallel checks and changes on a transformers model, layer by layer.

`checks` refuses what no forward can fix, `placement` follows accelerate's and tensor-parallel placements,
`recurrent` gives recurrent mixers a state per segment, `compiled_parts` runs the layers' norms and rotary
embedding through `torch.compile`, and `projections` runs q, k and v as one GEMM.
"""
