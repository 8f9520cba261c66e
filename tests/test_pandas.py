"""pandas in, pandas out: a DataFrame is channels by column, a Series one channel; the results keep
the index and columns, the index gives the times (dates with a time unit), and forecasts and
stream continuation work on such posteriors."""

import numpy as np
import pandas as pd
import pytest

import kalmanscan as ks

MODEL = dict(theta=np.array([0.1, 0.4]), sigma=np.array([0.5, 1.5]), obs_var=np.array([1.0, 0.3]))


def _frame(T=31, index=None, seed=0):
    y = np.random.default_rng(seed).normal(size=(T, 2))
    y[3, 1] = np.nan
    return pd.DataFrame(y, index=index, columns=["level", "flow"])


def _assert_same(post, ref, frame):
    for k in ("mean", "var", "precision", "pred_mean", "pred_var", "pred_obs_mean", "pred_obs_var", "logliks"):
        got = getattr(post, k)
        assert isinstance(got, pd.DataFrame), k
        assert got.index.equals(frame.index) and got.columns.equals(frame.columns), k
        np.testing.assert_array_equal(got.to_numpy(), getattr(ref, k), err_msg=k)
    assert isinstance(post.loglik, pd.Series) and post.loglik.index.equals(frame.columns)
    np.testing.assert_array_equal(post.loglik.to_numpy(), ref.loglik)


@pytest.mark.parametrize("op", [ks.filter, ks.smooth])
def test_dataframe_in_dataframes_out(op):
    df = _frame()
    post = op(df, **MODEL)
    _assert_same(post, op(df.to_numpy(), **MODEL), df)
    if op is ks.smooth:
        _assert_same(post.filtered, ks.filter(df.to_numpy(), **MODEL), df)
    assert "pandas DataFrame" in repr(post)
    for got, want in zip(post.gates(), op(df.to_numpy(), **MODEL).gates()):
        assert got.index.equals(df.index)
        np.testing.assert_array_equal(got.to_numpy(), want)
    np.testing.assert_array_equal(post.to_numpy().mean, op(df.to_numpy(), **MODEL).mean)


def test_series_is_one_channel_and_gives_series():
    s = pd.Series(np.random.default_rng(1).normal(size=20), name="volume",
                  index=pd.Index(np.arange(1871, 1891), name="year"))
    kw = dict(theta=0.0, sigma=1.0, obs_var=2.0, init_var=np.inf)
    post = ks.smooth(s, **kw)
    ref = ks.smooth(s.to_numpy()[:, None], **kw)
    for got, want in ((post.mean, ref.mean), (post.filtered.var, ref.filtered.var), (post.gates()[1], ref.gates()[1])):
        assert isinstance(got, pd.Series) and got.name == "volume" and got.index.equals(s.index)
        np.testing.assert_array_equal(got.to_numpy(), want[:, 0])
    assert post.loglik == ref.loglik[0]
    np.testing.assert_array_equal(post.to_numpy().var, ref.var)
    assert post.to_numpy().loglik.shape == (1,)
    fc = ks.forecast(post, steps=2)
    assert isinstance(fc.mean, pd.Series) and fc.mean.index.tolist() == [1891, 1892]
    np.testing.assert_allclose(fc.obs_var.to_numpy(), ks.forecast(ref, steps=2).obs_var[:, 0], rtol=1e-14)
    rest = ks.filter(pd.Series([0.5, -0.2], index=[1891, 1892], name="volume"), state=post, theta=0.0,
                     sigma=1.0, obs_var=2.0)
    whole = ks.filter(pd.concat([s, pd.Series([0.5, -0.2], index=[1891, 1892])]).rename("volume"), **kw)
    np.testing.assert_allclose(rest.mean.to_numpy(), whole.mean.to_numpy()[20:], rtol=1e-12)


def test_numeric_index_is_the_times():
    times = np.cumsum(np.random.default_rng(2).uniform(0.2, 2.0, size=25))
    df = _frame(25, index=pd.Index(times))
    post = ks.filter(df, **MODEL)
    np.testing.assert_array_equal(post.mean.to_numpy(), ks.filter(df.to_numpy(), times=times, **MODEL).mean)
    # dt or times given explicitly win: the index then only labels the rows
    np.testing.assert_array_equal(ks.filter(df, dt=0.5, **MODEL).mean.to_numpy(),
                                  ks.filter(df.to_numpy(), dt=0.5, **MODEL).mean)
    assert ks.filter(df, dt=0.5, **MODEL).mean.index.equals(df.index)


def test_dates_need_a_time_unit_and_count_in_it():
    dates = pd.DatetimeIndex(["2024-01-01", "2024-01-02", "2024-01-04", "2024-01-08", "2024-01-09"])
    df = _frame(5, index=dates)
    with pytest.raises(ValueError, match="time_unit is required"):
        ks.filter(df, **MODEL)
    post = ks.filter(df, time_unit="1D", **MODEL)
    ref = ks.filter(df.to_numpy(), times=[0.0, 1, 3, 7, 8], **MODEL)
    _assert_same(post, ref, df)
    zoned = df.set_axis(dates.tz_localize("Europe/Paris"))  # time zones: the times of the UTC instants
    _assert_same(ks.filter(zoned, time_unit="1D", **MODEL), ref, zoned)
    assert ks.forecast(ks.filter(zoned, time_unit="1D", **MODEL), steps=1).mean.index[0] == zoned.index[-1] + \
        pd.Timedelta("1D")
    hours = ks.filter(df, time_unit="h", **MODEL)
    np.testing.assert_allclose(hours.params["times"][:, 0], [0.0, 24, 72, 168, 192])
    with pytest.raises(ValueError, match="time_unit"):
        ks.filter(_frame(5), time_unit="1D", **MODEL)  # a RangeIndex holds no dates
    with pytest.raises(ValueError, match="time_unit"):
        ks.filter(df.to_numpy(), time_unit="1D", **MODEL)


def test_forecast_of_dates_is_indexed_by_dates():
    df = _frame(10, index=pd.date_range("2024-03-01", periods=10, freq="D"))
    post = ks.filter(df, time_unit="1D", **MODEL)
    fc = ks.forecast(post, steps=3)
    ref = ks.forecast(ks.filter(df.to_numpy(), **MODEL), steps=3)
    assert fc.mean.index.equals(pd.date_range("2024-03-11", periods=3, freq="D"))
    for k in ("mean", "var", "obs_mean", "obs_var"):
        np.testing.assert_allclose(getattr(fc, k).to_numpy(), getattr(ref, k), rtol=1e-14, err_msg=k)
    at = pd.DatetimeIndex(["2024-03-12", "2024-03-20"])
    fc = ks.forecast(post, times=at)
    assert fc.var.index.equals(at)
    np.testing.assert_allclose(fc.var.to_numpy(), ks.forecast(ks.filter(df.to_numpy(), **MODEL),
                                                              times=[11.0, 19.0]).var, rtol=1e-14)


def test_stream_continues_from_a_pandas_posterior():
    df = _frame(30, index=pd.date_range("2024-01-01", periods=30, freq="6h"))
    whole = ks.filter(df, time_unit="1D", **MODEL)
    first = ks.filter(df.iloc[:11], time_unit="1D", **MODEL)
    rest = ks.filter(df.iloc[11:], time_unit="1D", state=first, **MODEL)
    assert rest.mean.index.equals(df.index[11:])
    np.testing.assert_allclose(rest.mean.to_numpy(), whole.mean.to_numpy()[11:], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="state=post"):  # a StreamState does not know the first date
        ks.filter(df.iloc[11:], time_unit="1D", state=first.state, **MODEL)
    numbered = df.reset_index(drop=True)  # numbers are times: a StreamState continues them
    first = ks.filter(numbered.iloc[:11], **MODEL)
    rest = ks.filter(numbered.iloc[11:], state=first.state, **MODEL)
    np.testing.assert_allclose(rest.var.to_numpy(), ks.filter(numbered, **MODEL).var.to_numpy()[11:], rtol=1e-12)


def test_float32_columns_stay_float32_and_nothing_is_modified():
    df = _frame().astype(np.float32)
    before = df.copy()
    post = ks.filter(df, **MODEL)
    assert post.mean.dtypes.unique().tolist() == [np.float32]
    pd.testing.assert_frame_equal(df, before)


def test_nullable_and_integer_columns_read_as_float64():
    df = pd.DataFrame({"a": pd.array([1.0, None, 2.5, 3.0], dtype="Float64"), "b": [1, 2, 3, 4]})
    post = ks.filter(df, **MODEL)
    ref = ks.filter(np.array([[1.0, 1], [np.nan, 2], [2.5, 3], [3, 4]]), **MODEL)
    np.testing.assert_array_equal(post.mean.to_numpy(), ref.mean)


def test_bad_pandas_input_names_the_problem():
    df = _frame(5)
    df["note"] = "x"
    with pytest.raises(ValueError, match="y: column 'note' is not numeric"):
        ks.filter(df, theta=0.1, sigma=0.5, obs_var=1.0)
    with pytest.raises(ValueError, match="batch dimensions"):
        ks.filter(_frame(5), theta=np.full((2, 1, 2), 0.1), sigma=0.5, obs_var=1.0)


def test_fit_reads_the_index_as_filter_does():
    df = _frame(40, index=pd.date_range("2024-01-01", periods=40, freq="2D"))
    with pytest.raises(ValueError, match="time_unit is required"):
        ks.fit(df, max_iter=3)
    res = ks.fit(df, time_unit="1D", max_iter=10)
    ref = ks.fit(df.to_numpy(), times=np.arange(40) * 2.0, max_iter=10)
    np.testing.assert_array_equal(res.params["theta"], ref.params["theta"])
    post = res.filter(df)
    assert post.mean.index.equals(df.index)
    with pytest.raises(ValueError, match="time_unit"):
        ks.fit(df.to_numpy(), time_unit="1D")


def test_diagnostics_and_plots_take_pandas_posteriors_and_data():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = _frame(40, index=pd.date_range("2024-01-01", periods=40, freq="D"))
    for y in (df, df["level"]):
        post = ks.filter(y, time_unit="1D", theta=0.1, sigma=0.5, obs_var=1.0)
        arrays = df.to_numpy()[:, :np.ndim(y)]  # (T, 2), or (T, 1) for the Series
        ref = ks.filter(arrays, dt=1.0, theta=0.1, sigma=0.5, obs_var=1.0)
        assert ks.diagnostics.report(post, y).mean_nis == ks.diagnostics.report(ref, arrays).mean_nis
        np.testing.assert_array_equal(ks.diagnostics.pit(post, y), ks.diagnostics.pit(ref, arrays))
        for draw in (lambda: ks.plot.belief_band(post, y=y), lambda: ks.plot.nis(post, y),
                     lambda: ks.plot.reliability(post, y), lambda: ks.plot.pit_histogram(post, y),
                     lambda: ks.plot.gates(post)):
            plt.close(draw().figure)
