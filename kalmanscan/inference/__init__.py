"""Inference on a prepared problem: the filter (:mod:`.filtering`), the RTS smoother
(:mod:`.smoothing`), forecasts (:mod:`.forecasting`), streaming continuation (:mod:`.stream`,
:mod:`.stream_filter`), the exact diffuse prior (:mod:`.diffuse`) and the result object
(:mod:`.posterior`)."""
