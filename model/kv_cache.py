"""The KV cache: every layer's keys and values for a batch of sequences, in preallocated buffers."""

from typing import NamedTuple

import torch
import torch.nn as nn


class LayerKV(NamedTuple):
    """One layer's view of the cache, and the slots that this forward pass writes."""

    k: torch.Tensor  # (B, nh, max_len, hs)
    v: torch.Tensor  # (B, nh, max_len, hs)
    # where the T new keys and values go: (T,) slot ids, and attention reads all max_len slots, masked (static
    # shapes); or the slice start:end, and attention reads the filled slots [:end] only
    slots: torch.Tensor | slice

    def update(self, k_new, v_new):
        """Write the new keys/values (B, nh, T, hs) in place; return the slots that attention reads."""
        if isinstance(self.slots, slice):
            start, end = self.slots.start, self.slots.stop
            self.k.narrow(2, start, end - start).copy_(k_new)
            self.v.narrow(2, start, end - start).copy_(v_new)
            return self.k[:, :, :end], self.v[:, :, :end]
        self.k.index_copy_(2, self.slots, k_new.to(self.k.dtype))
        self.v.index_copy_(2, self.slots, v_new.to(self.v.dtype))
        return self.k, self.v


class KVCache(nn.Module):
    """Keys and values of all layers, (n_layer, B, n_head, max_len, head_dim), written in place.

    Slot s holds the s-th token fed since reset(). One counter, `pos` (the number of filled slots),
    decides where new keys and values are written, which slots a query may attend (its own and
    those before it: causal, aligned bottom-right, whether one token or a chunk is fed) and each
    token's position. `pos` is a 0-d tensor, so that a compiled one-token step has static shapes
    and does not recompile as it advances: compiled, queries attend to all max_len slots, masked.
    Eagerly on the CPU, where reading `pos` back costs nothing, they attend to the filled slots only,
    with no mask at all unless rows are padded (see for_tokens).

    Left-padded batches: row b's first n_pad[b] slots hold padding, which no query attends, and its
    tokens' positions count from its first real token.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int,
                 dtype=torch.float32, device=None):
        super().__init__()
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        # persistent=False: a cache is scratch space, never part of a checkpoint
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("pos", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self.register_buffer("n_pad", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("slot_ids", torch.arange(max_len, device=device), persistent=False)
        self.padded = False  # whether reset() was given left padding: then every step needs a mask

    @property
    def max_len(self) -> int:
        return self.k.size(3)

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values: 2 * n_layer * B * max_len * n_embd * itemsize."""
        return self.k.nbytes + self.v.nbytes

    def __len__(self) -> int:
        """Filled slots. Reads the counter back to the host (a sync on GPU): for tests and reports."""
        return int(self.pos)

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    def reset(self, n_pad=None) -> None:
        """Empty the cache; n_pad (B,) gives how many left-padding tokens each row will start with."""
        self.pos.zero_()
        self.n_pad.zero_() if n_pad is None else self.n_pad.copy_(n_pad)
        self.padded = n_pad is not None

    def layer(self, i: int, slots) -> LayerKV:
        return LayerKV(self.k[i], self.v[i], slots)

    @property
    def static_shapes(self) -> bool:
        """Whether a forward pass attends to all max_len slots, masked: when compiled (static shapes compile
        once), and off the CPU (the other way reads `pos` back, which waits for the device)."""
        return torch.compiler.is_compiling() or self.pos.device.type != "cpu"

    def for_tokens(self, t: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | slice]:
        """What a forward pass of the next t tokens needs: (their positions (B, t) or (t,), the attention
        mask (B, 1, t, T_k) or None for plain causal attention, their slots for layer()).

        With static_shapes attention reads all max_len slots through the mask. Otherwise it reads the filled
        slots [:end] only, and unpadded rows need no mask: the model's causal attention, aligned bottom-right,
        is exactly the cache's mask there. That spares each one-token step building the mask, and every
        layer converting it.
        """
        if self.static_shapes:
            slots = self.next_slots(t)
            return self.positions(slots), self.attn_mask(slots), slots
        start = int(self.pos)
        end = start + t
        new = self.slot_ids[start:end]  # (t,)
        if not self.padded:
            return new, None, slice(start, end)
        return self.positions(new), self.attn_mask(new)[..., :end], slice(start, end)

    def next_slots(self, t: int):
        """(t,) the slots the next t tokens go to."""
        return self.pos + self.slot_ids[:t]

    def positions(self, slots):
        """(B, t) position of each new token in its row, counted from the row's first real token."""
        return (slots[None, :] - self.n_pad[:, None]).clamp(min=0)

    def attn_mask(self, slots):
        """(B, 1, t, max_len) bool, True where a new token may attend a slot. Every token sees at least its
        own slot, so no row is ever fully masked and attention needs no guard against one: a padding token
        sees only itself, and no real token ever sees a padding slot."""
        causal = self.slot_ids[None, :] <= slots[:, None]  # (t, max_len); also hides unfilled slots
        not_pad = self.slot_ids[None, :] >= self.n_pad[:, None]  # (B, max_len)
        own = self.slot_ids[None, :] == slots[:, None]  # (t, max_len)
        return causal[None, None, :, :] & (not_pad[:, None, None, :] | own[None, None, :, :])

    def advance(self, t: int) -> None:
        self.pos += t
