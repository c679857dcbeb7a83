"""What a cache of a fixed budget of slots shares, whichever tokens it keeps (window.py keeps the last, sinks.py the
first and the last, evicting.py those its heads choose): rows that start together, a first chunk that fills it,
then one token per pass, eagerly, and no rollback."""

import torch

from ..protocol import Abilities
from .ring import CacheShape


class BudgetRules:
    """Mixed in before KVCache (model/kv_cache.py), whose buffers hold the budget's slots. kind: what it is, for
    messages; keeps: why rows must start together; moves: why it takes one token at a time once full."""

    abilities = Abilities(rolls_back=False, takes_padding=False, compiles=False, budgeted=True)
    kind, keeps, moves = "a budget cache", "keeps chosen tokens of each row", "each needs the step before"

    def reset(self, n_pad=None) -> None:
        if n_pad is not None and bool((n_pad > 0).any()):
            raise ValueError(f"{self.kind} {self.keeps}: its rows must start together, with no left padding")
        super().reset()

    @property
    def shape(self) -> CacheShape:
        return CacheShape(self.n_kv_layer, self.k0.size(1), self.head_dim, None, None, self.max_len, self.dtype)

    def longest_chunk(self) -> int:
        """Tokens up to the full cache in one pass, then one at a time."""
        return max(self.max_len - len(self), 1)

    def take(self, t: int) -> tuple[int, torch.Tensor]:
        """Count t new tokens as fed, once they are known to fit in one pass, eagerly: the tokens fed before them,
        and their numbers (t,), which are their positions since reset."""
        if torch.compiler.is_compiling():
            raise ValueError(f"{self.kind} decodes eagerly: drop compile")
        fed = len(self)
        if t > self.longest_chunk():
            raise ValueError(f"{self.kind} of {self.max_len} slots with {fed} tokens fed takes "
                             f"{self.longest_chunk()} tokens in one pass ({self.moves}), not {t}")
        new = self.pos + self.slot_ids[:t]
        self.pos += t
        return fed, new

    def rollback(self, n: int) -> None:
        if n:
            raise ValueError(f"{self.kind} cannot roll back: the tokens it dropped are gone; decode without "
                             f"speculation")
