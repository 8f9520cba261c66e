"""The filter and smoother of a dask-backed DataArray chunked along time, chunk by chunk, exactly.

No chunk is ever joined to another: each task holds one block (a chunk of series times a chunk of
time) and the chunks pass each other only beliefs, a few numbers per series. For the chunks
``0 .. n-1`` along time of one chunk of series (:mod:`kalmanscan.inference.stretches` has the
algebra):

1. chunk 0 is filtered from the prior; every later chunk ``i`` is summarised, independently of
   the belief entering it, as the product of its steps in the merged form (7 numbers per series);
2. one small task composes chunk 0's last belief with the summaries in time order: the filtered
   belief at the end of every chunk (an exclusive prefix, ``n - 2`` combines);
3. each chunk ``i >= 1`` is filtered from the belief at the end of chunk ``i - 1``
   (``ks.filter(..., state=)``: its prediction into the chunk's first step is the filter's own
   transition), so every block of the result equals the in-memory filter's to rounding.

The smoother goes back the same way: each chunk ``i >= 1`` maps the smoothed moments at its last
step to those at chunk ``i - 1``'s last step by one affine map (from its filter, 4 numbers per
series); one task composes them from the end (an exclusive suffix); then each chunk is smoothed
with the smoothed belief at its last step entered as a pseudo-observation there: the smoothed
belief is the filtered one times the likelihood of the later data, a Gaussian in the state, so
``ks.smooth`` of the chunk with that likelihood joined to its last observation is the smoother of
the whole record on the chunk (diffuse priors, gaps and per-step parameters handled by
``ks.smooth`` itself). The join needs the filtered belief at the chunk's last step, which the
prefix gives; the smoother's task filters its chunk once (inside ``ks.smooth``), its filtered
fields being that filter's but at the joined last step, where one step is filtered from the
prediction into it.

Tasks per chunk of series: ``n`` filters, ``n - 1`` summaries and one prefix for the filter; the
smoother adds ``n - 1`` link filters, one suffix and ``n`` smoothers. Memory per task: one block
(a chunk of ``y``) and its results: at most about 16 blocks of working memory in float64 (a
link's filter, or a smoother's beside its output of 9 fields).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import dask
import dask.array as dsa
import numpy as np
import torch

from kalmanscan.distributed.summaries import incoming_moments
from kalmanscan.inference import stretches
from kalmanscan.inference.filtering import filter as ks_filter
from kalmanscan.inference.smoothing import smooth as ks_smooth
from kalmanscan.inference.stream import StreamState
from kalmanscan.problem.prepare import prepare

__all__ = ["moments"]

_PRIOR = ("init_mean", "init_var")


def moments(op_name: str, y: dsa.Array, params: dict[str, tuple[dsa.Array, bool]], times: np.ndarray | None,
            static: dict, fields: Sequence[str]) -> dsa.Array:
    """The fields of ``ks.filter`` or ``ks.smooth`` (``op_name``) of ``y`` ``(..., T)`` (time
    last, chunked along it), stacked as ``(..., T, len(fields))`` with ``y``'s chunks.

    ``params`` maps a parameter's name to ``(array, per_step)``: ``(..., T)`` chunked as ``y``
    when per step, else ``(...)`` chunked as ``y``'s batch. ``times`` ``(T,)`` or ``None``;
    ``static``: the other keyword arguments of the call (scalars)."""
    names = list(params)
    blocks = y.to_delayed()
    par = {k: a.to_delayed() for k, (a, _) in params.items()}
    per_step = {k: s for k, (_, s) in params.items()}
    bounds = np.cumsum((0,) + y.chunks[-1])
    n = len(y.chunks[-1])
    nf = len(fields)
    grid = np.empty(blocks.shape, dtype=object)
    for b in itertools.product(*(range(k) for k in blocks.shape[:-1])):
        def chunk(i, b=b):
            arrays = {k: par[k][b + (i,)] if per_step[k] else par[k][b] for k in names}
            t = None if times is None else times[bounds[i]:bounds[i + 1]]
            before = None if times is None or i == 0 else float(times[bounds[i] - 1])
            return dict(y=blocks[b + (i,)], arrays=arrays, times=t, before=before)
        first = dask.delayed(_filter_first, nout=2)(**chunk(0), names=per_step, static=static,
                                                    fields=fields if op_name == "filter" else None)
        parts = [dask.delayed(_summary)(**chunk(i), names=per_step, static=static) for i in range(1, n - 1)]
        carried = dask.delayed(_carries)(first[1], parts)
        carries = [None] + [carried[i] for i in range(n - 1)]
        if op_name == "filter":
            outs = [first[0]] + [dask.delayed(_filter_from)(**chunk(i), carry=carries[i], names=per_step,
                                                            static=static, fields=fields) for i in range(1, n)]
        else:
            links = [dask.delayed(_link)(**chunk(i), carry=carries[i], last=i == n - 1, names=per_step,
                                         static=static) for i in range(1, n)]
            ended = dask.delayed(_suffix)(links)
            ends = [ended[i] for i in range(n - 1)] + [None]
            beliefs = carries[1:] + [None]  # the filtered belief at each chunk's last step
            outs = [dask.delayed(_smooth_chunk)(**chunk(i), carry=carries[i], end=ends[i], belief=beliefs[i],
                                                names=per_step, static=static, fields=fields) for i in range(n)]
        shape_b = tuple(y.chunks[d][b[d]] for d in range(len(b)))
        for i in range(n):
            shape = shape_b + (int(y.chunks[-1][i]), nf)
            grid[b + (i,)] = dsa.from_delayed(outs[i], shape=shape, dtype=y.dtype)
    return dsa.block(_nest(grid))


def _nest(grid: np.ndarray) -> list:
    """``grid``'s blocks as the nested lists :func:`dask.array.block` takes: the grid's last axis
    is time, the blocks' second-to-last; their last (the fields) is one block."""
    if grid.ndim == 1:
        return [[g] for g in grid]
    return [_nest(g) for g in grid]


def _flat(y: np.ndarray, arrays: dict, names: dict) -> tuple[np.ndarray, dict, tuple]:
    """``y (..., T) -> (T, n)`` and the parameters alike (per step ``(T, n)``, static ``(n,)``)."""
    batch, T = y.shape[:-1], y.shape[-1]
    n = math.prod(batch)
    flat = {k: (np.broadcast_to(a, batch + (T,)).reshape(n, T).T if names[k] else
                np.broadcast_to(a, batch).reshape(n)) for k, a in arrays.items()}
    return np.ascontiguousarray(y.reshape(n, T).T), flat, batch


def _unflat(post, fields: Sequence[str], batch: tuple, dtype) -> np.ndarray:
    """The filter's posterior's ``fields`` ``(T, n)`` stacked as ``batch + (T, len(fields))``."""
    out = np.empty(batch + (post.mean.shape[0], len(fields)), dtype=dtype)
    _write(out, fields, fields, lambda name: getattr(post, name))
    return out


def _write(out: np.ndarray, fields: Sequence[str], names: Sequence[str], value, last=None) -> None:
    """Write ``value(name)`` ``(T, n)`` for each of ``names`` into its column of ``out`` ``batch +
    (T, len(fields))``; with ``last`` (a filter's posterior ``(1, n)``) the last step's from
    ``last`` (the same field, ``filtered_`` left out)."""
    batch, T = out.shape[:-2], out.shape[-2]
    n = math.prod(batch)
    for name in names:
        i = fields.index(name)
        out[..., i] = np.broadcast_to(value(name), (T, n)).T.reshape(batch + (T,))
        if last is not None:
            out[..., -1, i] = np.broadcast_to(getattr(last, name.removeprefix("filtered_")), (1, n))[0].reshape(batch)


def _kwargs(flat: dict, static: dict, times, first: bool) -> dict:
    """The keyword arguments of a chunk's call: the prior only for the first chunk."""
    kw = {**static, **flat, "times": times}
    if not first:
        for k in _PRIOR:
            kw.pop(k, None)
    return kw


def _state(post) -> dict:
    """The belief at ``post``'s last step as plain arrays (a task's small output)."""
    s = post.state
    return dict(mean=np.asarray(s.mean), var=np.asarray(s.var), level=np.asarray(s.level),
                time=None if s.time is None else np.asarray(s.time), steps=s.steps)


def _filter_first(y, arrays, times, before, names, static, fields=None):
    """Chunk 0 filtered from the prior: ``(its fields or None, its last belief)``."""
    fy, flat, batch = _flat(y, arrays, names)
    post = ks_filter(fy, **_kwargs(flat, static, times, True), outputs=_outputs(fields))
    return (None if fields is None else _unflat(post, fields, batch, y.dtype)), _state(post)


def _problem(y, arrays, times, before, names, static):
    """Chunk ``i >= 1`` prepared with a placeholder prior (the summary does not read it) and the
    step into its first time from the previous chunk's last one."""
    fy, flat, _ = _flat(y, arrays, names)
    kw = _kwargs(flat, static, None, False)
    kw.pop("backend", None)
    if times is not None:
        kw["dt"] = _steps(times, before)
    return prepare(torch.from_numpy(fy), **kw, init_var=1.0, backend="torch"), flat


def _steps(times: np.ndarray, before: float) -> np.ndarray:
    """The steps ``(T, 1)`` into each of a chunk's ``times`` from the one before (``before``: the
    previous chunk's last time)."""
    return np.diff(np.concatenate([[before], times]))[:, None]


def _summary(y, arrays, times, before, names, static) -> dict:
    """Chunk ``i >= 1``'s merged-form summary ``(7, n)`` with its last step's level and time."""
    p, flat = _problem(y, arrays, times, before, names, static)
    with torch.no_grad():
        s = torch.cat(stretches.summary(p, first=False, backend="cpu"), -2).numpy()
    level = np.broadcast_to(flat.get("mean", static.get("mean", 0.0)), (y.shape[-1], s.shape[-1]))[-1]
    return dict(summary=s, level=np.array(level), time=None if times is None else float(times[-1]),
                steps=y.shape[-1])


def _carries(state0: dict, parts: list[dict]) -> list[StreamState]:
    """The filtered belief at the end of chunks ``0 .. n-2`` as stream states (an exclusive
    prefix of the summaries after chunk 0's last belief)."""
    var0 = torch.from_numpy(np.asarray(state0["var"], dtype=np.float64))
    mu0 = torch.from_numpy(np.asarray(state0["mean"] - state0["level"], dtype=np.float64))
    gathered = torch.stack([torch.stack(stretches.belief(var0, mu0))]
                           + [torch.from_numpy(q["summary"]).to(torch.float64) for q in parts])
    dtype = np.asarray(state0["mean"]).dtype
    states = [StreamState(mean=state0["mean"], var=state0["var"], level=state0["level"],
                          time=state0["time"], steps=state0["steps"])]
    steps = state0["steps"]
    for r, q in enumerate(parts, start=1):
        var, mu = (x.numpy().astype(dtype) for x in incoming_moments(gathered, r + 1))
        mu = np.where(np.isinf(var), 0.0, mu).astype(dtype)  # nothing observed yet (diffuse): no mean
        steps += q["steps"]
        time = None if q["time"] is None else np.array([q["time"]])
        states.append(StreamState(mean=mu + q["level"], var=var, level=q["level"], time=time, steps=steps))
    return states


def _filter_from(y, arrays, times, before, carry, names, static, fields):
    """Chunk ``i >= 1`` filtered from the belief at the end of chunk ``i - 1``."""
    fy, flat, batch = _flat(y, arrays, names)
    post = ks_filter(fy, **_kwargs(flat, static, times, False), state=carry, outputs=_outputs(fields))
    return _unflat(post, fields, batch, y.dtype)


def _outputs(fields: Sequence[str] | None) -> tuple[str, ...]:
    """The filter's outputs a chunk needs: ``fields`` and the mean and variance its last belief is."""
    return tuple(dict.fromkeys(("mean", "var", *(fields or ()))))


def _link(y, arrays, times, before, carry, last, names, static) -> np.ndarray:
    """Chunk ``i >= 1``'s RTS link ``(4, n)`` (:func:`kalmanscan.inference.stretches.rts_link`),
    from its filter's fields as tensors that share their memory (static ones expanded, not copied)."""
    fy, flat, _ = _flat(y, arrays, names)
    kw = _kwargs(flat, static, None, False)
    if times is not None:  # the steps as dt, so that the decay and noise at index 0 are the transition's
        kw["dt"] = _steps(times, before)
        carry = dataclasses.replace(carry, time=None)
    post = ks_filter(fy, **kw, state=carry)
    shape = post.mean.shape
    t = {k: _tensor(v, shape) for k, v in dict(mean=post.mean, var=post.var, pred_mean=post.pred_mean,
                                               pred_var=post.pred_var, decay=post.params["decay"],
                                               noise=post.params["noise"]).items()}
    level = _tensor(post.params["mean"], shape)
    del post
    var_prev = torch.from_numpy(np.asarray(carry.var, dtype=fy.dtype))
    mu_prev = torch.from_numpy(np.asarray(carry.mean - carry.level, dtype=fy.dtype))
    link = stretches.rts_link(t, level, (var_prev, mu_prev), last=last)
    return dict(link=link[:, 0, :].numpy(), level=np.asarray(carry.level))


def _tensor(x, shape: tuple) -> torch.Tensor:
    """``x`` as a tensor expanded to ``shape``, sharing its memory (copied when it is read-only)."""
    x = np.asarray(x)
    return torch.from_numpy(x if x.flags.writeable else x.copy()).expand(shape)


def _suffix(links: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The smoothed ``(mean, var)`` at the last step of chunks ``0 .. n-2`` (uncentred mean),
    composed from the last chunk's constant map back (an exclusive suffix)."""
    ends = []
    s_mean, s_var = links[-1]["link"][1], links[-1]["link"][3]
    ends.append((s_mean + links[-1]["level"], s_var))
    for q in links[-2::-1]:
        F_m, B_m, F_v, B_v = q["link"]
        s_mean, s_var = F_m * s_mean + B_m, F_v * s_var + B_v
        ends.append((s_mean + q["level"], s_var))
    return ends[::-1]


def _smooth_chunk(y, arrays, times, before, carry, end, belief, names, static, fields):
    """Chunk ``i`` smoothed given all the data: its own observations plus, at its last step,
    the likelihood of the later chunks' (``end``: the smoothed belief there; ``belief``: the
    filtered one, from the prefix). The chunk is filtered once, inside ``ks.smooth`` on the joined
    data: its filtered fields are that filter's at every step but the last, and at the last the
    unjoined filter's (:func:`_last_step`)."""
    fy, flat, batch = _flat(y, arrays, names)
    kw = _kwargs(flat, static, times, carry is None)
    state = {} if carry is None else {"state": carry}
    joined = end is not None
    y_joined, kw_joined = _join_later_data(fy, kw, belief, end) if joined else (fy, kw)
    post = ks_smooth(y_joined, **kw_joined, **state)
    del y_joined, kw_joined
    out = np.empty(batch + (fy.shape[0], len(fields)), dtype=y.dtype)
    own = [name for name in fields if name in ("mean", "var")]
    _write(out, fields, own, functools.partial(getattr, post))
    filtered = post.filtered
    del post  # the smoothed moments are written: freed before the filter's fields are derived
    last = _last_step(fy, kw, filtered) if joined else None
    _write(out, fields, [name for name in fields if name not in own],
           lambda name: getattr(filtered, name.removeprefix("filtered_")), last)
    return out


def _last_step(fy: np.ndarray, kw: dict, filtered):
    """The unjoined filter's posterior ``(1, n)`` at the chunk's last step: that observation
    filtered from the prediction into it (``filtered``'s, which the join does not change)."""
    T = fy.shape[0]
    step = {k: v[-1:] if (k == "times" or np.ndim(v) == 2) and v is not None else v for k, v in kw.items()}
    level = np.broadcast_to(kw.get("mean", 0.0), (T, fy.shape[1]))[-1]
    pred_mean, pred_var = filtered.pred_mean[-1], filtered.pred_var[-1]
    prior = dict(init_mean=np.where(np.isinf(pred_var), level, pred_mean), init_var=pred_var)
    return ks_filter(fy[-1:], **{**step, **prior})


def _join_later_data(fy: np.ndarray, kw: dict, belief: StreamState, end) -> tuple[np.ndarray, dict]:
    """``(y, kwargs)`` whose last observation also carries the later data's likelihood of the
    state there: ``N(x; m_b, v_b)`` with ``1/v_b = 1/var_s - 1/var_f`` and ``m_b/v_b = mean_s/var_s
    - mean_f/var_f`` (smoothed = filtered x later data's likelihood; the filtered ``belief`` at the
    last step), joined to ``y_T = h x + N(0, obs_var)`` as one observation of ``x`` (gain 1) with
    precision ``h^2/obs_var + 1/v_b``. Where the later data add nothing (``1/v_b = 0``) or the
    filtered variance is 0 the step is left as it is."""
    s_mean, s_var = end
    f_mean, f_var = np.asarray(belief.mean), np.asarray(belief.var)
    with np.errstate(divide="ignore", invalid="ignore"):
        info = np.maximum(1.0 / s_var - 1.0 / f_var, 0.0)
        shift = s_mean / s_var - f_mean / f_var
    T, n = fy.shape
    h = np.broadcast_to(kw.get("h", 1.0), (T, n)).astype(fy.dtype)
    obs_var = np.broadcast_to(kw["obs_var"], (T, n)).astype(fy.dtype)
    level = np.broadcast_to(kw.get("mean", 0.0), (T, n))[-1]
    y_last = fy[-1]
    seen = ~np.isnan(y_last)
    own_info = np.where(seen, h[-1] ** 2 / obs_var[-1], 0.0)
    own_shift = np.where(seen, h[-1] * (np.where(seen, y_last, 0.0) - h[-1] * level) / obs_var[-1], 0.0)
    join = (info > 0) & np.isfinite(info) & (f_var > 0)
    total = own_info + info
    later_shift = shift - info * level  # the later data's information mean, centred at the level
    y_join = level + (own_shift + later_shift) / np.where(join, total, 1.0)
    fy = fy.copy()
    fy[-1] = np.where(join, y_join, y_last)
    h = h.copy()
    h[-1] = np.where(join, 1.0, h[-1])
    obs_var = obs_var.copy()
    obs_var[-1] = np.where(join, 1.0 / np.where(join, total, 1.0), obs_var[-1])
    return fy, {**kw, "h": h, "obs_var": obs_var}
