"""``benchmarks.tables.markdown``: scalars on one line, lists of rows and dicts of rows as tables,
nested dicts as dotted columns."""

from benchmarks.tables import markdown


def test_markdown_of_a_nested_result():
    result = {"device": "GPU", "copy_GBps": 4247.123, "rows": [{"C": 1, "fwd": {"ms": 0.5, "pct": 50.0}},
                                                              {"C": 2, "fwd": {"ms": 1.25}, "note": "a|b"}],
              "kla": {"B": 8, "fwd": {"public": {"queued": 0.61}, "kernels": {"queued": 0.56}}},
              "fp32": {"rate": 3.0e13, "groups": [1.5, 2.0]}, "nothing": None}
    assert markdown(result) == [
        "device: GPU; copy_GBps: 4247; nothing: ", "",
        "*rows*", "", "| C | fwd.ms | fwd.pct | note |", "|---|---|---|---|",
        "| 1 | 0.5 | 50 |  |", "| 2 | 1.25 |  | a\\|b |", "",
        "*kla*: B: 8", "", "*kla.fwd*", "", "|  | queued |", "|---|---|", "| public | 0.61 |", "| kernels | 0.56 |", "",
        "*fp32*: rate: 3e+13; groups: 1.5, 2", ""]


def test_markdown_of_a_list_of_rows():
    assert markdown([{"a": 1}, {"b": [{"x": 1}]}]) == ["| a | b |", "|---|---|", "| 1 |  |", "|  | [1 rows] |", ""]
