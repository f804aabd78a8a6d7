"""What hf_parallel reads from the names transformers gives its classes; imports neither torch nor transformers
(the modules that use it may be imported without transformers).

Each docstring says what it relies on and the versions it was checked on; tests/test_compat.py checks each.
"""

from __future__ import annotations

# the class-name endings transformers gives its layers with a recurrent state (5.17, 5.25)
MIXER_SUFFIXES = (
    "GatedDeltaNet",
    "DeltaAttention",
    "Mixer",
    "MambaLayer",
    "ShortConv",
    "ShortConvolution",
    "LightningAttention",
)


def is_recurrent_mixer(module) -> bool:
    """Whether `module` is a layer with a recurrent state (gated delta nets, Mamba, short convolutions, lightning
    attention).

    Relies on: the class names transformers gives them ending in one of `MIXER_SUFFIXES`, and their `layer_idx`, the
    index of their state in the cache (5.17, 5.25)."""
    return type(module).__name__.endswith(MIXER_SUFFIXES) and isinstance(getattr(module, "layer_idx", None), int)


def is_attention_layer(module) -> bool:
    """Whether `module` is a decoder layer's attention module.

    Relies on: its class name ending in "Attention" and its `layer_idx`, the index of its K/V in the cache (5.17,
    5.25)."""
    return type(module).__name__.endswith("Attention") and hasattr(module, "layer_idx")
