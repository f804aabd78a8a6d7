"""Layers with a recurrent state (gated delta nets, Mamba, short convolutions, lightning attention).

Such a layer reads its tokens as one sequence per batch row, from one start state per
row.  In the packed row a forward holds tokens of many segments, so each segment needs
its own state, following the prefix tree as the KV does: a segment starts from its
parent's final state, a shared prefix's state is computed once, and each stream decodes
from its own state.  `SegmentedMixer` stands in for the model's mixer module during a
call and calls the unmodified mixer:

    prefill  once per run of one segment's tokens, parents before children, its start
             state loaded first (its own, kept under the segment's key, where the segment
             began in an earlier forward; else its parent's)
    decode   once, with the decoding streams' tokens as batch rows of length 1, each row's
             state gathered from the stream's lane of a pool: the model's own single-token path

A forward may hold both: its decode tokens come first, then the prompt runs.

The mixer reads and writes the state through transformers' own `LinearAttentionLayer`
at `cache.layers[layer_idx]` (`StateLayer`, through
`hf_parallel.compat.transformers_internals.RecurrentStateLayer`), so the model code is
unchanged.  Transformers' own continuous batching refuses these models, and its
packed-sequence arguments (`cu_seq_lens`, `seq_idx`) reach no CPU fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..compat.transformers_internals import RecurrentStateLayer
from ..compat.transformers_names import is_recurrent_mixer

MAX_STATES = 4  # conv or recurrent states one mixer may keep (most keep one)


def is_mixer(module: nn.Module) -> bool:
    """A layer with a recurrent state, by the class names transformers gives them (`is_recurrent_mixer`)."""
    return is_recurrent_mixer(module)


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


def _take(t, index):
    return None if t is None else t[index].clone()


class StateLayer(RecurrentStateLayer):
    """transformers' linear-attention cache layer, loaded with the state of the rows a mixer call runs.

    segments: final states of the runs prefilled so far (rows of one), by key, while still needed.
    pool:     [L, ...] each decoding stream's state, by lane (allocated at the first stream's start).
    """

    def __init__(self):
        super().__init__(MAX_STATES)
        self.segments: dict[int, State] = {}
        self.pool: State | None = None

    def load(self, state: State | None) -> None:
        """Put `state` where the mixer looks for it; None: a fresh sequence (the mixer allocates its state)."""
        if state is None:
            self.set_states(None, None)
        else:
            self.set_states(state.conv, state.rec)

    def read(self) -> State:
        return State(*self.states())

    def put(self, lanes: torch.Tensor, state: State, lane_count: int) -> None:
        """Write `state`'s rows into the pool at `lanes` [n] (the pool of `lane_count` lanes made at the first)."""
        if self.pool is None:
            self.pool = State(
                *({i: _lanes(t, lane_count) for i, t in part.items()} for part in (state.conv, state.rec))
            )
        for part, new in ((self.pool.conv, state.conv), (self.pool.rec, state.rec)):
            for i, t in new.items():
                if t is not None:
                    part[i][lanes] = t

    def stored_bytes(self) -> int:
        states = list(self.segments.values()) + ([self.pool] if self.pool is not None else [])
        tensors = [t for s in states for part in (s.conv, s.rec) for t in part.values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def _lanes(t, count: int):
    return None if t is None else t.new_zeros(count, *t.shape[1:])


@dataclass
class SegmentRuns:
    """How one forward's tokens split, for the layers with a recurrent state.

    lanes:  [D] int64 (device): the first D tokens are decode tokens, token i its stream's next, continuing the
            state of lane lanes[i] (None: no decode tokens).
    runs:   (key, parent key or None, first, end) of the prompt tokens after them, by runs of one segment in order:
            a run continues the state kept under its key, else its parent's, else starts fresh; its final state
            is kept under its key.
    start:  (lane, key) pairs: after the forward, lane `lane` holds a copy of the state kept under `key` (a
            stream starting from its prompt's end).
    forget: keys whose states no later forward needs, dropped after the forward's starts.
    lane_count: lanes of the pool.
    """

    lanes: torch.Tensor | None = None
    runs: list[tuple[int, int | None, int, int]] = field(default_factory=list)
    start: list[tuple[int, int]] = field(default_factory=list)
    forget: list[int] = field(default_factory=list)
    lane_count: int = 1


class SegmentedMixer(nn.Module):
    """Stands in for one recurrent mixer during a call: one start state per segment run (module docstring)."""

    def __init__(self, mixer: nn.Module, token_by_token: bool = False):
        """token_by_token: the mixer's multi-token path ignores a start state (Jamba's selective scan starts
        from zeros, whatever the cache holds): a segment that continues from a state then runs a token at a
        time, through the single-token path (the support probe finds out)."""
        super().__init__()
        self.mixer, self.layer_idx, self.token_by_token = mixer, mixer.layer_idx, token_by_token

    def forward(self, *args, **kwargs):
        """The mixer's output on the hidden states [1, N, hidden] (its tuple where it returns one): decode tokens as
        one batch row each, then each prompt run from its start state, as the PackedCache's `segment_runs` says."""
        if "hidden_states" in kwargs:
            hidden = kwargs.pop("hidden_states")
        else:
            hidden, args = args[0], args[1:]
        cache = next(v for v in kwargs.values() if hasattr(v, "segment_runs"))  # the PackedCache, by any name
        layer, runs = cache.layers[self.layer_idx], cache.segment_runs
        call = MixerCall(self.mixer, layer, args, kwargs)
        pieces = []
        if runs.lanes is not None and len(runs.lanes):
            pieces.append(self.decode(call, layer, hidden[:, : len(runs.lanes)], runs.lanes))
        if runs.runs:
            pieces.append(self.prefill(call, layer, hidden, runs))
        for lane, key in runs.start:
            layer.put(torch.tensor([lane], device=hidden.device), layer.segments[key], runs.lane_count)
        for key in runs.forget:
            layer.segments.pop(key, None)
        out = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        return (out, None) if call.returns_tuple else out

    def decode(self, call, layer: StateLayer, hidden: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
        """Every token is its stream's next one: one call, a batch row per token, states gathered and scattered."""
        out, state = call(hidden[0][:, None], layer.pool.rows(lanes))
        layer.put(lanes, state, len(lanes))
        return out[:, 0][None]

    def prefill(self, call, layer: StateLayer, hidden: torch.Tensor, runs: SegmentRuns) -> torch.Tensor:
        """Each run of one segment's tokens from its start state (its own so far, else its parent's final one);
        the outputs [1, T, hidden] in token order.  Keeps each run's final state under its key."""
        pieces = []
        for key, parent, first, end in runs.runs:
            state = layer.segments.get(key)  # a segment split across forwards continues from itself
            if state is None and parent is not None:
                state = layer.segments[parent].clone()
            if state is not None and self.token_by_token:
                for t in range(first, end):
                    piece, state = call(hidden[:, t : t + 1], state)
                    pieces.append(piece)
            else:
                piece, state = call(hidden[:, first:end], state)
                pieces.append(piece)
            layer.segments[key] = state
        return torch.cat(pieces, dim=1)


class MixerCall:
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


def segmented(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, mixer) of every recurrent mixer of `model`."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if is_mixer(child)
    ]
