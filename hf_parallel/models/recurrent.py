"""Layers with a recurrent state (gated delta nets, Mamba, short convolutions, lightning attention).

Such a layer reads its tokens as one sequence per batch row, from one start state per
row.  In the packed row a forward holds tokens of many segments, so each segment needs
its own state, following the prefix tree as the KV does: a segment starts from its
parent's final state, a shared prefix's state is computed once, and each stream decodes
from its own state.  `SegmentedMixer` stands in for the model's mixer module during a
call and calls the unmodified mixer:

    prefill  once per run of one segment's tokens, in slot order (pre-order: a parent's
             last token comes before its children's first), its start state loaded first
    decode   once, with the N tokens as N batch rows of length 1, each row's state
             gathered from the stream pool: the model's own single-token path

The mixer reads and writes the state through transformers' own `LinearAttentionLayer`
at `cache.layers[layer_idx]` (`StateLayer`), so the model code is unchanged in
transformers 5.17 and 5.24.  Transformers' own continuous batching refuses these models,
and its packed-sequence arguments (`cu_seq_lens`, `seq_idx`) reach no CPU fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import LinearAttentionLayer

MAX_STATES = 4  # conv or recurrent states one mixer may keep (most keep one)
MIXER_SUFFIXES = (
    "GatedDeltaNet",
    "DeltaAttention",
    "Mixer",
    "MambaLayer",
    "ShortConv",
    "ShortConvolution",
    "LightningAttention",
)


def is_mixer(module: nn.Module) -> bool:
    """A layer with a recurrent state, by the class names transformers gives them."""
    return type(module).__name__.endswith(MIXER_SUFFIXES) and isinstance(getattr(module, "layer_idx", None), int)


@dataclass
class State:
    """One layer's state of one or more rows: conv and recurrent tensors by state index (None: absent)."""

    conv: dict[int, torch.Tensor | None]
    rec: dict[int, torch.Tensor | None]

    def rows(self, index) -> State:
        """A copy of the rows `index` picks (an index tensor or a slice) of every tensor."""
        return State(*({i: _take(t, index) for i, t in part.items()} for part in (self.conv, self.rec)))

    def clone(self) -> State:
        return self.rows(slice(None))

    @staticmethod
    def cat(states: list[State]) -> State:
        """The states' rows one after another (all of one layer: the same state indices)."""
        first = states[0]
        conv = {i: _cat([s.conv[i] for s in states]) for i in first.conv}
        return State(conv, {i: _cat([s.rec[i] for s in states]) for i in first.rec})


def _take(t, index):
    return None if t is None else t[index].clone()


def _cat(parts):
    return None if parts[0] is None else torch.cat(parts)


class StateLayer(LinearAttentionLayer):
    """transformers' linear-attention cache layer, loaded with the state of the rows a mixer call runs.

    segments: final states of the segments prefilled so far (rows of one), while still needed.
    pool:     [P, ...] each stream's state during decode.
    """

    def __init__(self):
        super().__init__(number_of_states=MAX_STATES)
        self.segments: dict[int, State] = {}
        self.pool: State | None = None

    def load(self, state: State | None) -> None:
        """Put `state` where the mixer looks for it; None: a fresh sequence (the mixer allocates its state)."""
        for i in range(self.number_of_states):
            conv = None if state is None else state.conv.get(i)
            rec = None if state is None else state.rec.get(i)
            self.conv_states[i], self.recurrent_states[i] = conv, rec
            self.is_conv_states_initialized[i] = conv is not None
            self.is_recurrent_states_initialized[i] = rec is not None
            self.has_previous_state[i] = state is not None
            if conv is not None:
                self.conv_kernel_size[i] = conv.shape[-1]

    def read(self) -> State:
        return State(dict(self.conv_states), dict(self.recurrent_states))

    def stored_bytes(self) -> int:
        states = list(self.segments.values()) + ([self.pool] if self.pool is not None else [])
        tensors = [t for s in states for part in (s.conv, s.rec) for t in part.values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class SegmentRuns:
    """How one forward's tokens split by segment, for the layers with a recurrent state.

    runs:     prefill: [(segment, first token, end token)] in slot order; None in decode.
    parents:  prefill: parent segment of every segment (-1 for a root).
    ends:     prefill: pre-order end of every segment (its subtree is segments [s, ends[s])).
    keep:     prefill: segments whose final state the decode pool needs (where a prompt ends).
    rows:     decode: [N] int64, the stream (pool row) of each token.
    """

    runs: list[tuple[int, int, int]] | None = None
    parents: list[int] | None = None
    ends: list[int] | None = None
    keep: frozenset[int] = frozenset()
    rows: torch.Tensor | None = None


class SegmentedMixer(nn.Module):
    """Stands in for one recurrent mixer during a call: one start state per segment run (module docstring)."""

    def __init__(self, mixer: nn.Module, token_by_token: bool = False):
        """token_by_token: the mixer's multi-token path ignores a start state (Jamba's selective scan starts
        from zeros, whatever the cache holds): a segment that continues from a state then runs a token at a
        time, through the single-token path (the support probe finds out)."""
        super().__init__()
        self.mixer, self.layer_idx, self.token_by_token = mixer, mixer.layer_idx, token_by_token

    def forward(self, *args, **kwargs):
        """The mixer's output on the hidden states [1, N, hidden] (its tuple where it returns one): per segment run
        in prefill, one batch row per stream in decode, as the PackedCache's `segment_runs` says."""
        if "hidden_states" in kwargs:
            hidden = kwargs.pop("hidden_states")
        else:
            hidden, args = args[0], args[1:]
        cache = next(v for v in kwargs.values() if hasattr(v, "segment_runs"))  # the PackedCache, by any name
        layer, runs = cache.layers[self.layer_idx], cache.segment_runs
        call = Call(self.mixer, layer, args, kwargs)
        if runs.rows is not None:
            out = self.decode(call, layer, hidden, runs.rows)
        else:
            out = self.prefill(call, layer, hidden, runs)
        return (out, None) if call.returns_tuple else out

    def decode(self, call, layer: StateLayer, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Every token is its stream's next one: one call, a batch row per token, states gathered and scattered."""
        out, state = call(hidden[0][:, None], layer.pool.rows(rows))
        for part, new in ((layer.pool.conv, state.conv), (layer.pool.rec, state.rec)):
            for i, t in new.items():
                if t is not None:
                    part[i][rows] = t
        return out[:, 0][None]

    def prefill(self, call, layer: StateLayer, hidden: torch.Tensor, runs: SegmentRuns) -> torch.Tensor:
        """Each run of one segment's tokens from its start state (its own so far, else its parent's final one);
        the outputs [1, N, hidden] in token order.  Keeps the final states later runs or the decode pool need."""
        pieces = []
        for seg, first, end in runs.runs:
            state = layer.segments.get(seg)  # a segment split across prefill chunks continues from itself
            if state is None and runs.parents[seg] >= 0:
                state = layer.segments[runs.parents[seg]].clone()
            if state is not None and self.token_by_token:
                for t in range(first, end):
                    piece, state = call(hidden[:, t : t + 1], state)
                    pieces.append(piece)
            else:
                piece, state = call(hidden[:, first:end], state)
                pieces.append(piece)
            layer.segments[seg] = state
            _forget_finished(layer.segments, seg, runs)
        return torch.cat(pieces, dim=1)


class Call:
    """The unmodified mixer on some rows: load their state, run, read the state back."""

    def __init__(self, mixer, layer: StateLayer, args, kwargs):
        self.mixer, self.layer, self.args, self.kwargs = mixer, layer, args, kwargs
        self.returns_tuple = False

    def __call__(self, hidden: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        self.layer.load(state)
        out = self.mixer(hidden, *self.args, **self.kwargs)
        if isinstance(out, tuple):  # MiniMax's lightning attention returns (output, state)
            self.returns_tuple, out = True, out[0]
        return out, self.layer.read()


def _forget_finished(segments: dict[int, State], current: int, runs: SegmentRuns) -> None:
    """Drop the states no later run needs: segments whose whole subtree lies before `current`, unless kept."""
    for seg in [s for s in segments if runs.ends[s] <= current and s not in runs.keep]:
        del segments[seg]


def segmented(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, mixer) of every recurrent mixer of `model`."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if is_mixer(child)
    ]
