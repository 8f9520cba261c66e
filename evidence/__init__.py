"""The paper-evidence harness: task evaluations of the KLA layer against baseline mixers, the
synthetic tasks trained by one entry point, text by another (speed benchmarks are in
``benchmarks/``). Not installed with the package; run from the repository root.

    evidence.tasks      seeded generators (group word problems, MQAR, the MAD suite) and the text corpus
    evidence.train      the training entry point of the synthetic tasks (``python -m evidence.train``)
    evidence.protocols  the reduced protocols: several runs in parallel processes, JSON out
    evidence.plots      figures and tables from the JSON results
    evidence.reach      how far back a mixer hears at initialisation (its gradient by lag)
    evidence.lm         byte-level language models on the Python standard library's source
                        (``python -m evidence.lm train|throughput|protocol``; models in
                        evidence.lm_models, tables and curves by ``python -m evidence.lm_report``)
    evidence.calibration, evidence.checkpoint   what ``train`` uses: variance calibration
                        checks of a trained model, pause and resume

Results are written under ``benchmarks/results/`` by default.
"""
