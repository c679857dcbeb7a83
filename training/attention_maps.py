"""Each layer's attention map, as TensorBoard shows it (training/summaries.py): a grey grid of its heads, or, where
matplotlib is installed, the heads with the characters along their axes and a colour bar."""

import math

import numpy as np
import torch

HEAD_PIXELS = 256  # about the side of each head's map: small prompts get cells of several pixels
LABELLED = 64  # the most characters labelled along an axis of a head's map: longer prompts label every n-th
COLOURS = "viridis"  # the labelled maps' colour scale: dark to bright, and read alike by the colour-blind
BAR = 0.5  # the grey of the bars between heads


def shown(character: str) -> str:
    """A character as a person can see it: a newline as ↵, other characters that print nothing as ·."""
    return "↵" if character == "\n" else character if character.isprintable() else "·"


def heads_in_a_grid(weights: torch.Tensor) -> torch.Tensor:
    """One layer's attention weights (n_head, T, T) as one grey image (H, W) in [0, 1]: each head's map with every
    row scaled to its own maximum and every cell a square of whole pixels; the heads in rows of ceil(sqrt(n_head)),
    left to right and top to bottom, grey bars between them (and grey where a row has no more heads)."""
    n_head, size, _ = weights.shape
    cell = max(1, HEAD_PIXELS // size)
    side, bar = size * cell, max(2, cell)
    maps = (weights / weights.amax(dim=-1, keepdim=True)).float().cpu()
    maps = maps.repeat_interleave(cell, dim=1).repeat_interleave(cell, dim=2)  # (n_head, side, side)
    columns = math.ceil(math.sqrt(n_head))
    rows = math.ceil(n_head / columns)
    image = torch.full((rows * (side + bar) - bar, columns * (side + bar) - bar), BAR)
    for head, heatmap in enumerate(maps):
        top, left = head // columns * (side + bar), head % columns * (side + bar)
        image[top:top + side, left:left + side] = heatmap
    return image


class LabelledHeads:
    """matplotlib's frame for one layer's heads on one text, drawn once: a head's axes with the characters along
    them (a space as ␣), its title, and one colour bar. Each evaluation paints its maps into the frame's boxes, so
    that the costly text is drawn once a run. The heads go in rows of ceil(sqrt(n_head)), as in heads_in_a_grid."""

    def __init__(self, n_head: int, text: str):
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # imported here: train.py runs without it
        from matplotlib.figure import Figure

        size = len(text)
        columns = math.ceil(math.sqrt(n_head))
        rows = math.ceil(n_head / columns)
        ticks = list(range(0, size, math.ceil(size / LABELLED)))
        labels = ["␣" if text[i] == " " else shown(text[i]) for i in ticks]
        side = 1.2 + 0.1 * len(ticks)  # inches a head: room for a label a row
        figure = Figure(figsize=(columns * side + 1, rows * side), dpi=100, layout="constrained")
        axes = list(figure.subplots(rows, columns, squeeze=False).flat)
        for head, ax in enumerate(axes):
            if head >= n_head:
                ax.set_axis_off()
                continue
            drawn = ax.imshow(np.zeros((size, size)), cmap=COLOURS, vmin=0, vmax=1)
            ax.set_title(f"head {head}")
            ax.set_xticks(ticks, labels, fontsize=7)
            ax.set_yticks(ticks, labels, fontsize=7)
            ax.tick_params(length=0)
            ax.set_xlabel("key: the character attended to")
            ax.set_ylabel("query: the character attending")
        figure.colorbar(drawn, ax=axes[:n_head], label="weight / its row's maximum")
        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        self.frame = torch.from_numpy(np.asarray(canvas.buffer_rgba())[..., :3].copy())  # uint8
        height = self.frame.shape[0]
        self.boxes = []  # (top, left, bottom, right) in pixels: inside each head's axes, its frame line kept
        for ax in axes[:n_head]:
            box = ax.get_window_extent()  # from the bottom left
            self.boxes.append((round(height - box.y1) + 1, round(box.x0) + 1, round(height - box.y0) - 1,
                               round(box.x1) - 1))
        self.colours = torch.from_numpy(drawn.cmap(np.linspace(0, 1, 256), bytes=True)[:, :3].copy())
        self.unseen = torch.ones(size, size, dtype=torch.bool).triu(1)  # later keys, never seen: left white
        self.size = size

    def __call__(self, weights: torch.Tensor) -> torch.Tensor:
        """One layer's attention weights (n_head, T, T) as an RGB image (H, W, 3) of uint8: each row scaled to its
        own maximum, as in heads_in_a_grid; the keys a query never sees left white."""
        maps = (weights / weights.amax(dim=-1, keepdim=True)).float().cpu()
        cells = self.colours[(maps * 255).round().long().clamp(0, 255)]  # (n_head, T, T, 3)
        cells[:, self.unseen] = 255
        image = self.frame.clone()
        for head, (top, left, bottom, right) in enumerate(self.boxes):
            rows = torch.arange(bottom - top) * self.size // (bottom - top)  # the query each pixel row shows
            columns = torch.arange(right - left) * self.size // (right - left)
            image[top:bottom, left:right] = cells[head][rows[:, None], columns[None, :]]
        return image
