"""Token tensors (or lists) in, chat-shaped samples out: select rows, transfer once, decode once."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

from .._records.tokens import encoded
from .._records.types import Sample, finite_or_none
from .._security import shown
from ._align import MISSING, Shortfall
from ._rows import as_python, as_tensor, check_rows, is_tensor, python_rows, real_tokens
from ._text import SpanBatch, TextBatch
from ._text_ends import RowText, flatten, text_ends
from ._token_fields import token_columns
from ._turns import Run, Turns, mask_runs, split_span_turns, split_turns

if TYPE_CHECKING:
    import torch

__all__ = ["decode_rollouts", "row_scores"]


def _is_ndarray(value: Any) -> bool:
    # Like `is_tensor`: an array can only exist once numpy is imported.
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def _row_count(input_ids: Any) -> int:
    if is_tensor(input_ids):
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids: expected a 2-D tensor (samples x tokens), got shape {tuple(input_ids.shape)}"
            )
        return int(input_ids.shape[0])
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
        raise ValueError(
            f"input_ids: expected a 2-D tensor or a list of token lists, got {type(input_ids).__name__}"
        )
    return len(input_ids)


@dataclass(slots=True, eq=False)
class _Layout:
    """The selected rows as Python data: their tokens, loss-mask runs and version ranges.

    The list path gives each row's tokens as a list (`tokens`). The tensor path gives every
    row's real tokens in one flat CPU array (`flat`: numpy, or a CPU tensor), row after row,
    with each row's offset into it and its length: the text is decoded from there, without a
    Python list per row.
    """

    runs: list[list[Run]] | None
    vmin: list[int | None] | None
    vmax: list[int | None] | None
    _: KW_ONLY
    tokens: list[list[int]] | None = None
    flat: Any = None
    offsets: list[int] | None = None
    lengths: list[int] | None = None


def _tensor_layout(
    input_ids: torch.Tensor,
    attention_mask: Any,
    loss_mask: Any,
    versions: Any,
    picked: list[int] | None,
) -> _Layout:
    """Everything per token is worked out on the tensors' own device; only results cross to the CPU.

    Rows are selected on the device first, then what the samples need crosses to the CPU once
    for the whole batch: the real tokens of every row in one flat tensor, and one small tensor
    holding the row lengths, the loss-mask cuts and the version ranges. A per-sample `.cpu()`
    or `.item()` would force one device sync per sample. `picked=None` means every row, in
    order, with no selection copy.

    Tensors already on the CPU are worked out with numpy on views of their memory (no copy,
    no transfer), which is several times faster there than torch's kernels and never waits on
    torch's thread pool; the same results, computed the same way.
    """
    import torch

    shape = tuple(input_ids.shape)
    per_token = {"attention_mask": attention_mask, "loss_mask": loss_mask, "versions": versions}
    for name, value in per_token.items():
        if value is None:
            continue
        if _is_ndarray(value):
            # A numpy array becomes a CPU tensor (sharing its memory); `select` moves it.
            value = per_token[name] = as_tensor(value, name)
        if not is_tensor(value):
            raise ValueError(f"{name}: input_ids is a tensor, so {name} must be one too (or a numpy array)")
        if tuple(value.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} does not match input_ids {shape}")
    attention_mask, loss_mask, versions = per_token.values()

    device = input_ids.device
    index = None if picked is None else torch.as_tensor(picked, dtype=torch.long, device=device)

    def select(value: torch.Tensor) -> torch.Tensor:
        # Rows are picked where the tensor lives, so only kept rows ever move between devices.
        if index is not None:
            value = value.index_select(0, index if value.device == device else index.to(value.device))
        return value.to(device)

    ids = select(input_ids)
    n_rows, width = ids.shape
    gen = select(loss_mask) if loss_mask is not None else None
    valid = select(attention_mask) if attention_mask is not None else None
    ver = select(versions) if versions is not None else None
    if ver is not None and ver.dtype != torch.long:
        ver = ver.long()
    parts = None
    if device.type == "cpu":
        parts = _numpy_parts(ids, valid, gen, ver)
    if parts is None:
        parts = _device_parts(ids, valid, gen, ver)
    return _assemble(parts, n_rows, width)


@dataclass(slots=True, eq=False)
class _Parts:
    """What the samples need from the tensors, on the CPU: the flat real tokens and small lists.

    `flat`: every row's real tokens, row after row; `lengths`: tokens per row (None: all the
    width); `cuts`: sorted positions in `flat` where the loss mask changes, `first`: its value
    at each row's first token (None: no loss mask); `lo`, `hi`: per-row version range, `hi`
    -1 for a row without any version (None: no versions).
    """

    flat: Any
    lengths: list[int] | None = None
    cuts: list[int] | None = None
    first: list[int] | None = None
    lo: list[int] | None = None
    hi: list[int] | None = None


def _device_parts(
    ids: torch.Tensor, valid: torch.Tensor | None, gen: torch.Tensor | None, ver: torch.Tensor | None
) -> _Parts:
    """`_Parts` computed on the tensors' device: the flat tokens and one small tensor cross over."""
    import torch

    def nonzero(value: torch.Tensor) -> torch.Tensor:
        return value if value.dtype == torch.bool else value != 0

    n_rows, width = ids.shape
    gen = nonzero(gen) if gen is not None else None
    lengths = None
    if valid is None:
        flat = ids.reshape(-1)
        gen_flat = gen.reshape(-1) if gen is not None else None
    else:
        valid = nonzero(valid)
        # The real tokens row after row, each row's in order: left or right padding, and the
        # holes of packed masks, all come out the same.
        flat = ids.masked_select(valid)
        gen_flat = gen.masked_select(valid) if gen is not None else None
        lengths = valid.sum(dim=1)
    total = int(flat.shape[0])

    # The small results share one transfer.
    small: list[torch.Tensor] = []
    if lengths is not None:
        small.append(lengths)
    n_cuts = 0
    if gen_flat is not None and total:
        cuts = (gen_flat[1:] != gen_flat[:-1]).nonzero().squeeze(1) + 1
        n_cuts = int(cuts.shape[0])
        if lengths is not None:
            offsets = lengths.cumsum(0) - lengths
        else:
            offsets = torch.arange(n_rows, device=ids.device) * width
        small += [cuts, gen_flat[offsets.clamp(max=total - 1)].long()]
    if ver is not None and width:
        # AReaL marks prompt tokens with version -1: they say nothing about the policy.
        ok = ver >= 0
        if valid is not None:
            ok &= valid
        small.append(torch.where(ok, ver, torch.iinfo(ver.dtype).max).amin(dim=1))
        small.append(torch.where(ok, ver, -1).amax(dim=1))
    values = torch.cat(small).cpu().tolist() if small else []

    parts = _Parts(flat.cpu())
    pos = 0
    if lengths is not None:
        parts.lengths = values[:n_rows]
        pos = n_rows
    if gen_flat is not None:
        parts.cuts, parts.first = [], []
        if total:
            parts.cuts = values[pos : pos + n_cuts]
            parts.first = values[pos + n_cuts : pos + n_cuts + n_rows]
            pos += n_cuts + n_rows
    if ver is not None:
        if width:
            parts.lo = values[pos : pos + n_rows]
            parts.hi = values[pos + n_rows : pos + 2 * n_rows]
        else:
            parts.lo = parts.hi = [-1] * n_rows
    return parts


def _numpy_parts(
    ids: torch.Tensor, valid: torch.Tensor | None, gen: torch.Tensor | None, ver: torch.Tensor | None
) -> _Parts | None:
    """`_Parts` for CPU tensors, computed with numpy on views of them; None if numpy can't."""
    try:
        import numpy as np

        ids_a = ids.numpy()
        valid_a = valid.numpy() if valid is not None else None
        gen_a = gen.numpy() if gen is not None else None
        ver_a = ver.numpy() if ver is not None else None
    except (ImportError, RuntimeError, TypeError):
        # No numpy, or a tensor numpy cannot view (one that requires grad, say): use torch.
        return None
    n_rows, width = ids_a.shape
    if gen_a is not None and gen_a.dtype != np.bool_:
        gen_a = gen_a != 0
    if valid_a is None:
        flat = ids_a.reshape(-1)
        gen_flat = gen_a.reshape(-1) if gen_a is not None else None
    else:
        if valid_a.dtype != np.bool_:
            valid_a = valid_a != 0
        flat = ids_a[valid_a]
        gen_flat = gen_a[valid_a] if gen_a is not None else None
    parts = _Parts(flat, lengths=valid_a.sum(axis=1).tolist() if valid_a is not None else None)
    total = int(flat.shape[0])
    if gen_flat is not None:
        parts.cuts, parts.first = [], []
        if total:
            parts.cuts = (np.flatnonzero(gen_flat[1:] != gen_flat[:-1]) + 1).tolist()
            lengths = parts.lengths if parts.lengths is not None else [width] * n_rows
            offsets = np.cumsum([0, *lengths[:-1]])
            parts.first = gen_flat[np.minimum(offsets, total - 1)].astype(np.int64).tolist()
    if ver_a is not None:
        if width:
            # AReaL marks prompt tokens with version -1: they say nothing about the policy.
            ok = ver_a >= 0
            if valid_a is not None:
                ok &= valid_a
            parts.lo = np.where(ok, ver_a, np.iinfo(ver_a.dtype).max).min(axis=1).tolist()
            parts.hi = np.where(ok, ver_a, -1).max(axis=1).tolist()
        else:
            parts.lo = parts.hi = [-1] * n_rows
    return parts


def _assemble(parts: _Parts, n_rows: int, width: int) -> _Layout:
    """The layout from the parts: row offsets, loss-mask runs and version ranges per row."""
    lengths = parts.lengths if parts.lengths is not None else [width] * n_rows
    offsets = list(itertools.accumulate(lengths, initial=0))[:-1]
    runs: list[list[Run]] | None = None
    if parts.cuts is not None and parts.first is not None:
        runs = [[] for _ in range(n_rows)]
        _cut_runs(runs, parts.cuts, parts.first, offsets, lengths)
    vmin: list[int | None] | None = None
    vmax: list[int | None] | None = None
    if parts.lo is not None and parts.hi is not None:
        # Versions are int64 and only those >= 0 count: a row's max is -1 when it has none.
        vmin = [lo if hi >= 0 else None for lo, hi in zip(parts.lo, parts.hi, strict=True)]
        vmax = [hi if hi >= 0 else None for hi in parts.hi]
    return _Layout(runs, vmin, vmax, flat=parts.flat, offsets=offsets, lengths=lengths)


def _cut_runs(
    runs: list[list[Run]], cuts: list[int], first: list[int], offsets: list[int], lengths: list[int]
) -> None:
    """Each row's loss-mask runs from the sorted cut positions in the flat token array.

    A cut inside a row starts a new run with the other mask value; a cut at a row's first
    token only separates it from the row before.
    """
    k = 0
    n_cuts = len(cuts)
    for j, length in enumerate(lengths):
        if not length:
            continue
        base = offsets[j]
        end = base + length
        while k < n_cuts and cuts[k] <= base:
            k += 1
        row = runs[j]
        position, flag = 0, bool(first[j])
        while k < n_cuts and cuts[k] < end:
            cut = cuts[k] - base
            row.append((position, cut, flag))
            position, flag = cut, not flag
            k += 1
        row.append((position, length, flag))


def _list_layout(
    input_ids: Sequence[Sequence[int]],
    attention_mask: Any,
    loss_mask: Any,
    versions: Any,
    picked: list[int],
) -> _Layout:
    n = len(input_ids)
    ids = python_rows(input_ids, picked, "input_ids", n)
    per_token: dict[str, list[list[Any]]] = {}
    for name, value in (("attention_mask", attention_mask), ("loss_mask", loss_mask), ("versions", versions)):
        if value is None:
            continue
        per_token[name] = python_rows(value, picked, name, n, ids)
    if "attention_mask" in per_token:
        keep = per_token.pop("attention_mask")
        ids = real_tokens(ids, keep)
        per_token = {name: real_tokens(rows, keep) for name, rows in per_token.items()}
    runs = [mask_runs(row) for row in per_token["loss_mask"]] if "loss_mask" in per_token else None
    vmin: list[int | None] | None = None
    vmax: list[int | None] | None = None
    if "versions" in per_token:
        seen = [[int(v) for v in row if v >= 0] for row in per_token["versions"]]
        vmin = [min(row) if row else None for row in seen]
        vmax = [max(row) if row else None for row in seen]
    return _Layout(runs, vmin, vmax, tokens=ids)


def _column(
    values: Any, picked: list[int], name: str, short: Shortfall, broadcast: bool = False
) -> list[Any] | None:
    """One value per selected row from an optional per-sample column (MISSING where it falls short)."""
    if values is None:
        return None
    if is_tensor(values):
        if values.dim() == 0:
            if broadcast:
                return [values.item()] * len(picked)
            raise ValueError(f"{name}: expected one value per sample, got a 0-d tensor")
        import torch

        have = int(values.shape[0])
        present = [r for r in picked if r < have]
        if len(present) < len(picked):
            short.note(name, have)
        index = torch.as_tensor(present, dtype=torch.long, device=values.device)
        chosen = iter(values.index_select(0, index).cpu().tolist())
        return [next(chosen) if r < have else MISSING for r in picked]
    values = as_python(values)
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        if broadcast:
            return [values] * len(picked)
        raise ValueError(f"{name}: expected one value per sample, got {type(values).__name__}")
    have = len(values)
    column = [values[r] if r < have else MISSING for r in picked]
    if any(r >= have for r in picked):
        short.note(name, have)
    return column


def _plain(value: Any) -> Any:
    """numpy arrays and scalars, and tensors, as Python numbers or lists; the rest is kept."""
    if is_tensor(value):
        return value.tolist()
    return as_python(value)


def _scalar(value: Any, name: str, allow_bool: bool = False) -> Any:
    """A per-sample number; a one-element row (from an [n, 1] tensor) counts as its element."""
    if value is MISSING or value is None:
        return MISSING
    # Converted before unwrapping: a 0-d tensor or a one-element array is a number too.
    value = _plain(value)
    if isinstance(value, list) and len(value) == 1:
        value = _plain(value[0])
    if isinstance(value, bool) and allow_bool:
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected one number per sample, got {type(value).__name__}")
    return value


def row_scores(rewards: Any, n_rows: int) -> list[float | None]:
    """Per-row rewards as floats with a single transfer; None where missing or not finite.

    What a sampler needs to choose rows before anything is decoded. Rows beyond a short
    `rewards` get None (no warning here: decoding those rows warns).
    """
    if rewards is None:
        return [None] * n_rows
    short = Shortfall("row_scores", n_rows)
    column = _column(rewards, list(range(n_rows)), "rewards", short)
    numbers = [_scalar(value, "rewards", allow_bool=True) for value in column or []]
    return [finite_or_none(number) if number is not MISSING else None for number in numbers]


def _text_ends(tokenizer: Any, layout: _Layout, turns: list[Turns], decoded: list[str]) -> list[bytes | None]:
    """Each sample's `text_ends` (`_text_ends`), None where its tokenizer cannot say."""
    if layout.tokens is not None:
        flat = flatten(layout.tokens)
        lengths = [len(row) for row in layout.tokens]
    else:
        flat, lengths = layout.flat, layout.lengths or []
    offsets = list(itertools.accumulate(lengths, initial=0))[:-1]
    rows = [
        RowText(offset, length, t.spans, [decoded[handle] for _, handle in t.turns])
        for offset, length, t in zip(offsets, lengths, turns, strict=True)
    ]
    return text_ends(tokenizer, flat, rows)


def decode_rollouts(
    input_ids: Any,
    *,
    tokenizer: Any,
    loss_mask: Any = None,
    attention_mask: Any = None,
    prompt_lens: Any = None,
    rewards: Any = None,
    versions: Any = None,
    metadata: Mapping[str, Any] | None = None,
    env_role: str = "tool",
    rows: Sequence[int] | None = None,
    token_fields: Mapping[str, Any] | None = None,
) -> list[Sample]:
    """Turn a batch of token sequences into chat-shaped samples, in the order of `rows`.

    `input_ids` is a 2-D tensor (right- or left-padded; `attention_mask` says which tokens are
    real) or a list of token lists. `loss_mask` (per token, nonzero where the policy generated
    the token) splits each sequence into turns: the first 0-run is the user prompt, each 1-run
    an `assistant` turn, each later 0-run an `env_role` turn. `prompt_lens` marks the prompt
    instead (one user and one assistant message when there is no loss mask). `rewards`,
    `prompt_lens` and every column of `metadata` hold one value per sample; a column that is
    shorter than the batch is left out of the samples it does not reach, with one warning.
    `versions` (per token) gives `policy_version_min` / `policy_version_max`, ignoring -1.

    Only the rows in `rows` are selected (on the tensors' device), each tensor crosses to the
    CPU once, and every turn of every sample is decoded in one pass (see docs/rollouts.md).

    `token_fields` keeps per-token arrays with each sample (`Sample.tokens`): a dict from a
    token field's name (``token_ids``, ``loss_mask``, ``logprobs``, ``ref_logprobs``,
    ``entropy``, ``advantages``) to an array shaped like `input_ids` (for instance
    ``{"token_ids": input_ids, "logprobs": old_log_probs}``); each sample keeps the values at its
    real tokens, compactly encoded, and with a byte-level BPE tokenizer ``text_ends`` too: where
    each token's text ends in its messages, for `asynctrace view` (see docs/rollouts.md).
    """
    if not isinstance(env_role, str) or not env_role:
        raise ValueError(f"env_role: expected a non-empty role name, got {shown(env_role)}")
    if _is_ndarray(input_ids) and any(is_tensor(v) for v in (attention_mask, loss_mask, versions)):
        # Mixed with tensors, numpy token ids take the tensor path (a CPU tensor on their memory).
        input_ids = as_tensor(input_ids, "input_ids")
    input_ids = as_python(input_ids)
    n = _row_count(input_ids)
    picked = check_rows(rows, n)
    if is_tensor(input_ids):
        layout = _tensor_layout(
            input_ids, attention_mask, loss_mask, versions, None if rows is None else picked
        )
    else:
        layout = _list_layout(input_ids, attention_mask, loss_mask, versions, picked)

    short = Shortfall("decode_rollouts", n)
    lens = _column(prompt_lens, picked, "prompt_lens", short)
    reward_col = _column(rewards, picked, "rewards", short)
    extra = {
        name: _column(values, picked, f"metadata[{name!r}]", short, broadcast=True)
        for name, values in (metadata or {}).items()
    }

    prompt_lens_l: list[int | None] = [None] * len(picked)
    if lens is not None:
        given = [_scalar(value, "prompt_lens") for value in lens]
        prompt_lens_l = [None if value is MISSING else int(value) for value in given]

    row_runs: Sequence[list[Run] | None] = layout.runs if layout.runs is not None else [None] * len(picked)
    turns: list[Turns] = []
    texts: TextBatch | SpanBatch
    if layout.tokens is not None:
        texts = TextBatch()
        for j, tokens in enumerate(layout.tokens):
            turns.append(split_turns(tokens, row_runs[j], prompt_lens_l[j], env_role, texts))
    else:
        assert layout.offsets is not None and layout.lengths is not None
        texts = SpanBatch(layout.flat)
        for j, (offset, length) in enumerate(zip(layout.offsets, layout.lengths, strict=True)):
            turns.append(split_span_turns(offset, length, row_runs[j], prompt_lens_l[j], env_role, texts))
    decoded = texts.decode(tokenizer)
    token_rows = (
        token_columns(token_fields, input_ids, attention_mask, picked, is_tensor(input_ids))
        if token_fields
        else None
    )
    if token_rows is not None and token_fields is not None and "text_ends" not in token_fields:
        # What the viewer's token page cuts the text by: given with the other token fields.
        for j, ends in enumerate(_text_ends(tokenizer, layout, turns, decoded)):
            if ends is not None:
                token_rows[j]["text_ends"] = encoded("int32", ends)

    samples: list[Sample] = []
    for j, row in enumerate(picked):
        t = turns[j]
        meta: dict[str, Any] = {"sample_index": row}
        if reward_col is not None:
            reward = _scalar(reward_col[j], "rewards", allow_bool=True)
            if reward is not MISSING:
                try:
                    meta["reward"] = float(reward)
                except OverflowError:
                    # An int beyond a float (10**400): kept as given, so that encoding refuses
                    # this row alone (a RecordError, or "invalid" under on_invalid="skip").
                    meta["reward"] = reward
        meta["prompt_len"] = t.prompt_len
        meta["response_len"] = t.seq_len - t.prompt_len
        meta["seq_len"] = t.seq_len
        meta["num_turns"] = t.num_turns
        if layout.vmin is not None and layout.vmax is not None and layout.vmin[j] is not None:
            meta["policy_version_min"] = layout.vmin[j]
            meta["policy_version_max"] = layout.vmax[j]
        for name, column in extra.items():
            if column is not None and column[j] is not MISSING:
                meta[name] = column[j]
        samples.append(
            Sample(messages=t.messages(decoded), metadata=meta, tokens=token_rows[j] if token_rows else None)
        )
    short.warn()
    return samples
