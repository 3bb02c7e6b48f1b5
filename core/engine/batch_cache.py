"""The hf engine's KV cache and attention mask for a continuously batched decode, preallocated.

`BatchCache` is a transformers `Cache` whose layers write each step's keys and values into buffers
that grow by doubling, and hand the model views of the live region. The attention mask lives beside
them on the model's device. So a decode step writes one column (keys, values and mask) instead of
concatenating the whole cache and mask and uploading the mask again, and admitting requests copies
only the new rows. The live region of every row is columns `[start, end)` of its buffer row;
the rows are left-padded, so each row attends to a contiguous tail `[first_col, end)`:

- `append_rows` joins freshly prefilled rows below the running ones, right-aligned to `end`;
- `decode_mask` opens column `end` for the token about to be fed and returns the mask view; asked for
  more rows than are live, it also opens padding rows below them for that one forward (an engine that
  wants every decode step's matrices at least that tall: `core.engine.hf`'s repeatable sampling);
- `keep_rows` retires rows by moving the last survivors into the holes (only moved rows are copied)
  and drops columns no survivor attends to by moving `start`, without copying.

It deliberately knows nothing of requests, sampling or the model: the engine (`core.engine.hf`)
owns those and keeps its row list in the order `keep_rows` returns. Every method that writes the
buffers runs in inference mode whoever calls it: a buffer grown inside a decode step is an inference
tensor, and writing it from outside inference mode (a retirement, say) is refused by torch. Sliding-window, quantised or
linear-attention layers are not handled: the engine's models use full attention.
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_COLUMNS = 64  # the smallest column capacity: a short prompt does not reallocate on every early step


class _SlabLayer(DynamicLayer):
    """One model layer's keys and values: `[row capacity, heads, column capacity, head dim]` buffers."""

    def __init__(self, owner: BatchCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.keys_buf, self.values_buf = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._refresh_views()

    def _refresh_views(self) -> None:
        o = self.owner
        self.keys = self.keys_buf[: o.seen, :, o.start : o.end]
        self.values = self.values_buf[: o.seen, :, o.start : o.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o, t = self.owner, key_states.shape[-2]
        if o.end + t > self.keys_buf.shape[2]:
            raise RuntimeError("BatchCache: no room for the step's columns (decode_mask reserves them first)")
        self.keys_buf[: o.seen, :, o.end : o.end + t] = key_states
        self.values_buf[: o.seen, :, o.end : o.end + t] = value_states
        keys = self.keys_buf[: o.seen, :, o.start : o.end + t]
        values = self.values_buf[: o.seen, :, o.start : o.end + t]
        self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self) -> int:
        return self.owner.end - self.owner.start


class BatchCache(Cache):
    def __init__(self, max_rows: int):
        super().__init__(layers=[])
        self.max_rows = max_rows
        self.rows = 0
        self.seen = 0  # the rows the next forward sees: the live ones, and any padding rows decode_mask opened
        self.start = self.end = 0  # the live columns of every row
        self.first_col: list[int] = []  # per row, the first column it attends to
        self.mask_buf: torch.Tensor | None = None
        self.reallocations = 0  # how many times the buffers were grown: a test and a bench read it

    @property
    def width(self) -> int:
        return self.end - self.start

    @torch.inference_mode()
    def append_rows(self, prefill: DynamicCache, mask: torch.Tensor) -> None:
        """Join `n` prefilled rows (their `[n, t]` left-padded CPU mask and KV cache) below the running ones."""
        n, t = mask.shape
        width = max(self.width, t)
        if not self.layers or self.rows + n > self.mask_buf.shape[0] or self.end - width < 0:
            self._reallocate(prefill, rows=self.rows + n, width=width, room=0)
        new_start, lo, hi = self.end - width, self.rows, self.rows + n
        for layer, fresh in zip(self.layers, prefill.layers):
            for buf, data in ((layer.keys_buf, fresh.keys), (layer.values_buf, fresh.values)):
                # Columns newly exposed to the running rows may hold a retired row's values (NaN from a
                # diverged model, say): masked or not, NaN * 0 is NaN, so they are zeroed.
                buf[:lo, :, new_start : self.start] = 0
                buf[lo:hi, :, new_start : self.end - t] = 0
                buf[lo:hi, :, self.end - t : self.end] = data
        self.mask_buf[:lo, new_start : self.start] = 0
        self.mask_buf[lo:hi, new_start : self.end - t] = 0
        self.mask_buf[lo:hi, self.end - t : self.end] = mask.to(self.mask_buf.device)
        self.first_col += [self.end - int(k) for k in mask.sum(1).tolist()]  # a CPU tensor: no device sync
        self.rows = self.seen = hi
        self.start = new_start
        self._refresh()

    @torch.inference_mode()
    def decode_mask(self, rows: int = 0) -> torch.Tensor:
        """Reserve the column of the token about to be fed, open it for every row and return the mask, of
        at least `rows` rows: rows beyond the live ones are padding for this one forward, their buffer rows
        whatever a retired row left (their outputs are the caller's to drop; no row's output depends on
        another's), their whole live region open so that their attention has something to weigh."""
        seen = max(self.rows, rows)
        if self.end + 1 > self.mask_buf.shape[1] or seen > self.mask_buf.shape[0]:
            self._reallocate(None, rows=seen, width=self.width, room=1)
        self.mask_buf[: self.rows, self.end] = 1
        self.mask_buf[self.rows : seen, self.start : self.end + 1] = 1
        self.seen = seen
        self._refresh()
        return self.mask_buf[:seen, self.start : self.end + 1]

    def advance(self, t: int = 1) -> None:
        """After a forward that fed `t` tokens per row: those columns are now part of the live region."""
        self.end += t
        self.seen = self.rows
        self._refresh()

    @torch.inference_mode()
    def keep_rows(self, keep: list[int]) -> list[int]:
        """Keep only rows `keep` (ascending). Returns the kept rows' old indices in their new order: the
        last survivors move into the holes, so only they are copied."""
        n = len(keep)
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in keep if i >= n]
        order = list(range(n))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        if holes:
            dst = torch.tensor(holes, device=self.mask_buf.device)
            src = torch.tensor(movers, device=self.mask_buf.device)
            cols = slice(self.start, self.end)
            for layer in self.layers:
                layer.keys_buf[dst, :, cols] = layer.keys_buf[src, :, cols]
                layer.values_buf[dst, :, cols] = layer.values_buf[src, :, cols]
            self.mask_buf[dst, cols] = self.mask_buf[src, cols]
        self.first_col = [self.first_col[i] for i in order]
        self.rows = self.seen = n
        if n:  # columns no surviving row attends to are dead weight: drop them from the left
            self.start = max(self.start, min(self.first_col))
        self._refresh()
        return order

    def _reallocate(self, prefill: DynamicCache | None, rows: int, width: int, room: int) -> None:
        """Grow the buffers (capacities doubling) and move the live region to the right of `width`."""
        old_rows, old_width = self.rows, self.width
        row_cap = max(rows, min(self.max_rows, 2 * (self.mask_buf.shape[0] if self.layers else rows)))
        col_cap = max(MIN_COLUMNS, 2 * (width + room))
        template = self.layers or [None] * len(prefill.layers)
        like = [(layer.keys_buf, layer.values_buf) for layer in self.layers] or [
            (fresh.keys, fresh.values) for fresh in prefill.layers]
        new_end = width  # the live region ends at `width`, leaving `col_cap - width` columns to grow into
        layers = []
        for layer, (k, v) in zip(template, like):
            keys = k.new_zeros((row_cap, k.shape[1], col_cap, k.shape[3]))
            values = v.new_zeros((row_cap, v.shape[1], col_cap, v.shape[3]))
            if layer is not None and old_rows:
                keys[:old_rows, :, new_end - old_width : new_end] = layer.keys_buf[:old_rows, :, self.start : self.end]
                values[:old_rows, :, new_end - old_width : new_end] = layer.values_buf[:old_rows, :, self.start : self.end]
            layers.append(_SlabLayer(self, keys, values))
        device = like[0][0].device
        mask = torch.zeros((row_cap, col_cap), dtype=torch.long, device=device)
        if self.mask_buf is not None and old_rows:
            mask[:old_rows, new_end - old_width : new_end] = self.mask_buf[:old_rows, self.start : self.end]
        shift = new_end - self.end
        self.first_col = [c + shift for c in self.first_col]
        self.layers, self.mask_buf = layers, mask
        self.start, self.end = new_end - old_width, new_end
        self.reallocations += 1

    def _refresh(self) -> None:
        for layer in self.layers:
            layer._refresh_views()
