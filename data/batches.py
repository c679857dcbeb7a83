"""Random training batches: windows of block_size tokens at random offsets, the targets one token further on."""

import numpy as np
import torch

from .errors import DataError


class Batches:
    """Draws (x, y) batches from a 1-D token array (typically a memmap), y being x shifted one token to the left.

    Offsets come from a torch.Generator of its own, seeded with `seed`, so the batches depend only on the seed and
    on how many were drawn (not on the global RNG), and state_dict() / load_state_dict() resume them exactly.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, device="cpu", seed: int = 0):
        if tokens.ndim != 1:
            raise DataError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if block_size < 1 or batch_size < 1:
            raise DataError(f"block_size and batch_size must be at least 1, got {block_size} and {batch_size}")
        if block_size >= len(tokens):
            raise DataError(f"block_size {block_size} must be smaller than the {len(tokens)} tokens it samples "
                            f"from; lower block_size or use more data")
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.device = torch.device(device)
        self._window = np.arange(block_size)
        self._generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x and y as int64 tensors of shape (batch_size, block_size) on the device."""
        n_offsets = len(self.tokens) - self.block_size  # the last window's target ends on the last token
        offsets = torch.randint(n_offsets, (self.batch_size, 1), generator=self._generator).numpy()
        positions = offsets + self._window  # one vectorised gather per tensor, no Python loop over the batch
        x = torch.from_numpy(self.tokens[positions].astype(np.int64))
        y = torch.from_numpy(self.tokens[positions + 1].astype(np.int64))
        if self.device.type == "cuda":
            # from pinned host memory the copies run asynchronously, overlapping the GPU's work
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self) -> dict:
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("generator"), torch.Tensor):
            raise DataError("batch state has no 'generator' tensor; pass a dict from Batches.state_dict()")
        # a checkpoint loaded with map_location="cuda" brings the state on the GPU; the generator lives on the CPU
        self._generator.set_state(state["generator"].cpu())
