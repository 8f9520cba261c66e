"""Parameter estimation: :func:`.fitting.fit` (maximum likelihood by gradient), its objective
(:mod:`.likelihood`, with the compiled CPU objective in :mod:`.cpu_objective`), the optimisers
(:mod:`.optimize`, :mod:`.graphed`) and the result (:mod:`.result`)."""
