"""Token tensors (or lists) in, chat-shaped samples out: select rows, transfer once, decode once."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._record import Sample
from ._align import MISSING, Shortfall
from ._text import TextBatch
from ._turns import Run, Turns, mask_runs, split_turns

if TYPE_CHECKING:
    import torch

__all__ = ["decode_rollouts", "row_scores"]


def _is_tensor(value: Any) -> bool:
    # A tensor can only exist once torch is imported, so looking it up never imports it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _as_python(value: Any) -> Any:
    """numpy arrays (anything with `tolist` that is not a tensor) become lists; the rest is kept."""
    if not _is_tensor(value) and hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    return value


def _row_count(input_ids: Any) -> int:
    if _is_tensor(input_ids):
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


def _check_rows(rows: Sequence[int] | None, n: int) -> list[int]:
    if rows is None:
        return list(range(n))
    if hasattr(rows, "tolist"):
        rows = rows.tolist()
    picked: list[int] = []
    for row in rows:
        if isinstance(row, bool) or not isinstance(row, int):
            raise ValueError(f"rows: expected ints, got {type(row).__name__}")
        if not 0 <= row < n:
            raise ValueError(f"rows: {row} is out of range for {n} samples")
        picked.append(row)
    return picked


class _Layout:
    """The selected rows as Python data: each row's tokens, its loss-mask runs, its version range."""

    __slots__ = ("runs", "tokens", "vmax", "vmin")

    def __init__(
        self,
        tokens: list[list[int]],
        runs: list[list[Run]] | None,
        vmin: list[int | None] | None,
        vmax: list[int | None] | None,
    ) -> None:
        self.tokens = tokens
        self.runs = runs
        self.vmin = vmin
        self.vmax = vmax


def _check_shape(value: Any, name: str, shape: tuple[int, ...]) -> None:
    if tuple(value.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(value.shape)} does not match input_ids {shape}")


def _tensor_layout(
    input_ids: torch.Tensor,
    attention_mask: Any,
    loss_mask: Any,
    versions: Any,
    picked: list[int] | None,
) -> _Layout:
    """Everything per token is worked out on the tensors' own device; only results cross to the CPU.

    Rows are selected on the device first, then each tensor crosses to the CPU once for the
    whole batch: a per-sample `.cpu()` or `.item()` would force one device sync per sample.
    `picked=None` means every row, in order, with no selection copy.
    """
    import torch

    shape = tuple(input_ids.shape)
    for name, value in (("attention_mask", attention_mask), ("loss_mask", loss_mask), ("versions", versions)):
        if value is not None:
            if not _is_tensor(value):
                raise ValueError(f"{name}: input_ids is a tensor, so {name} must be one too")
            _check_shape(value, name, shape)

    device = input_ids.device
    index = None if picked is None else torch.as_tensor(picked, dtype=torch.long, device=device)

    def select(value: torch.Tensor) -> torch.Tensor:
        # Rows are picked where the tensor lives, so only kept rows ever move between devices.
        if index is not None:
            value = value.index_select(0, index if value.device == device else index.to(value.device))
        return value.to(device)

    def nonzero(value: torch.Tensor) -> torch.Tensor:
        return value if value.dtype == torch.bool else value != 0

    ids = select(input_ids)
    n_rows, width = ids.shape
    gen = nonzero(select(loss_mask)) if loss_mask is not None else None
    ver = select(versions) if versions is not None else None
    if ver is not None and ver.is_floating_point():
        ver = ver.long()
    if attention_mask is None:
        valid = None
        starts = torch.zeros(n_rows, dtype=torch.long, device=device)
        lengths = torch.full((n_rows,), width, dtype=torch.long, device=device)
    else:
        valid = nonzero(select(attention_mask))
        lengths = valid.sum(dim=1)
        starts = valid.to(torch.uint8).argmax(dim=1)
        # One block of real tokens per row (left or right padding) has at most one rising edge.
        blocks = valid[:, :1].sum(dim=1) + (valid[:, 1:] & ~valid[:, :-1]).sum(dim=1)
        if bool((blocks > 1).any()):
            # Real tokens are not one block per row (packed or odd masks): move them to the front
            # of each row, keeping their order, so that every row reads as right-padded.
            order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices
            ids = ids.gather(1, order)
            gen = gen.gather(1, order) if gen is not None else None
            ver = ver.gather(1, order) if ver is not None else None
            valid = valid.gather(1, order)
            starts = torch.zeros_like(starts)

    ids_cpu = ids.cpu()
    bounds = torch.stack([starts, lengths]).cpu().tolist()
    row_starts, row_lengths = bounds[0], bounds[1]
    tokens = [
        ids_cpu[j, s : s + n].tolist() for j, (s, n) in enumerate(zip(row_starts, row_lengths, strict=True))
    ]

    runs: list[list[Run]] | None = None
    if gen is not None:
        runs = _tensor_runs(gen, starts, lengths, row_starts, row_lengths)

    vmin, vmax = _tensor_versions(ver, valid) if ver is not None else (None, None)
    return _Layout(tokens, runs, vmin, vmax)


def _tensor_versions(
    ver: torch.Tensor, valid: torch.Tensor | None
) -> tuple[list[int | None], list[int | None]]:
    """Per-row min and max policy version on the device, one small transfer for both."""
    import torch

    n_rows, width = ver.shape
    if not width:
        return [None] * n_rows, [None] * n_rows
    # AReaL marks prompt tokens with version -1: they say nothing about the policy.
    ok = ver >= 0
    if valid is not None:
        ok &= valid
    lo = torch.where(ok, ver, torch.iinfo(ver.dtype).max).amin(dim=1).long()
    hi = torch.where(ok, ver, -1).amax(dim=1).long()
    has = ok.any(dim=1).long()
    lo_l, hi_l, has_l = torch.stack([lo, hi, has]).cpu().tolist()
    return (
        [x if h else None for x, h in zip(lo_l, has_l, strict=True)],
        [x if h else None for x, h in zip(hi_l, has_l, strict=True)],
    )


def _tensor_runs(
    gen: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    row_starts: list[int],
    row_lengths: list[int],
) -> list[list[Run]]:
    """Loss-mask runs of every row, found on the device; only the run boundaries are transferred."""
    import torch

    n_rows, width = gen.shape
    runs: list[list[Run]] = [[] for _ in range(n_rows)]
    if not n_rows or not width:
        return runs
    rows, cols = (gen[:, 1:] != gen[:, :-1]).nonzero(as_tuple=True)
    cols = cols + 1
    inside = (cols > starts[rows]) & (cols < starts[rows] + lengths[rows])
    rows, cols = rows[inside], cols[inside]
    first = gen.gather(1, starts.clamp(max=width - 1).unsqueeze(1)).squeeze(1)
    # One transfer for every boundary: the rows, columns and mask values at each cut, and the
    # mask value at each row's first real token.
    flat = torch.cat([rows, cols, gen[rows, cols].long(), first.long()]).cpu().tolist()
    n_cuts = int(rows.shape[0])
    rows_l = flat[:n_cuts]
    cols_l = flat[n_cuts : 2 * n_cuts]
    flags_l = flat[2 * n_cuts : 3 * n_cuts]
    first_l = flat[3 * n_cuts :]
    k = 0
    for j in range(n_rows):
        length = row_lengths[j]
        if not length:
            continue
        base = row_starts[j]
        position, flag = 0, bool(first_l[j])
        while k < n_cuts and rows_l[k] == j:
            cut = cols_l[k] - base
            runs[j].append((position, cut, flag))
            position, flag = cut, bool(flags_l[k])
            k += 1
        runs[j].append((position, length, flag))
    return runs


def _python_rows(value: Any, picked: list[int], name: str, n: int) -> list[list[Any]]:
    value = _as_python(value)
    if _is_tensor(value):
        raise ValueError(
            f"{name}: input_ids is a list, so {name} must be a list too (or use tensors for all)"
        )
    if len(value) != n:
        raise ValueError(f"{name}: has {len(value)} rows but input_ids has {n}")
    return [list(_as_python(value[r])) for r in picked]


def _real_tokens(rows: list[list[Any]], attention: list[list[Any]]) -> list[list[Any]]:
    """The values of each row where the attention mask is set."""
    return [
        [x for x, m in zip(row, mask, strict=True) if m] for row, mask in zip(rows, attention, strict=True)
    ]


def _list_layout(
    input_ids: Sequence[Sequence[int]],
    attention_mask: Any,
    loss_mask: Any,
    versions: Any,
    picked: list[int],
) -> _Layout:
    n = len(input_ids)
    ids = _python_rows(input_ids, picked, "input_ids", n)
    per_token: dict[str, list[list[Any]]] = {}
    for name, value in (("attention_mask", attention_mask), ("loss_mask", loss_mask), ("versions", versions)):
        if value is None:
            continue
        rows = _python_rows(value, picked, name, n)
        for j, (row, tokens) in enumerate(zip(rows, ids, strict=True)):
            if len(row) != len(tokens):
                raise ValueError(
                    f"{name}: row {picked[j]} has {len(row)} values but input_ids has {len(tokens)} tokens"
                )
        per_token[name] = rows
    if "attention_mask" in per_token:
        keep = per_token.pop("attention_mask")
        ids = _real_tokens(ids, keep)
        per_token = {name: _real_tokens(rows, keep) for name, rows in per_token.items()}
    runs = [mask_runs(row) for row in per_token["loss_mask"]] if "loss_mask" in per_token else None
    vmin: list[int | None] | None = None
    vmax: list[int | None] | None = None
    if "versions" in per_token:
        seen = [[int(v) for v in row if v >= 0] for row in per_token["versions"]]
        vmin = [min(row) if row else None for row in seen]
        vmax = [max(row) if row else None for row in seen]
    return _Layout(ids, runs, vmin, vmax)


def _column(
    values: Any, picked: list[int], name: str, short: Shortfall, broadcast: bool = False
) -> list[Any] | None:
    """One value per selected row from an optional per-sample column (MISSING where it falls short)."""
    if values is None:
        return None
    if _is_tensor(values):
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
    values = _as_python(values)
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        if broadcast:
            return [values] * len(picked)
        raise ValueError(f"{name}: expected one value per sample, got {type(values).__name__}")
    have = len(values)
    column = [values[r] if r < have else MISSING for r in picked]
    if any(r >= have for r in picked):
        short.note(name, have)
    return column


def _scalar(value: Any, name: str) -> Any:
    """A per-sample number; a one-element row (from an [n, 1] tensor) counts as its element."""
    if value is MISSING or value is None:
        return MISSING
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    value = _as_python(value)
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
    scores: list[float | None] = []
    for value in column or []:
        number = _scalar(value, "rewards")
        scores.append(float(number) if number is not MISSING and math.isfinite(number) else None)
    return scores


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
    CPU once, and every turn of every sample is decoded in one tokenizer call.
    """
    if not isinstance(env_role, str) or not env_role:
        raise ValueError(f"env_role: expected a non-empty role name, got {env_role!r}")
    input_ids = _as_python(input_ids)
    n = _row_count(input_ids)
    picked = _check_rows(rows, n)
    if _is_tensor(input_ids):
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

    texts = TextBatch()
    turns: list[Turns] = []
    for j, tokens in enumerate(layout.tokens):
        prompt_len = None
        if lens is not None:
            prompt_len = _scalar(lens[j], "prompt_lens")
            prompt_len = None if prompt_len is MISSING else int(prompt_len)
        row_runs = layout.runs[j] if layout.runs is not None else None
        turns.append(split_turns(tokens, row_runs, prompt_len, env_role, texts))
    decoded = texts.decode(tokenizer)

    samples: list[Sample] = []
    for j, row in enumerate(picked):
        t = turns[j]
        meta: dict[str, Any] = {"sample_index": row}
        if reward_col is not None:
            reward = _scalar(reward_col[j], "rewards")
            if reward is not MISSING:
                meta["reward"] = float(reward)
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
        samples.append(Sample(messages=t.messages(decoded), metadata=meta))
    short.warn()
    return samples
