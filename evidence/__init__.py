"""The paper-evidence harness: task evaluations of the KLA layer against baseline mixers, all
trained by one entry point (speed benchmarks are in ``benchmarks/``). Not installed with the
package; run from the repository root.

    evidence.tasks      seeded generators (group word problems, MQAR, the MAD suite)
    evidence.train      the single training entry point (``python -m evidence.train``)
    evidence.protocols  the reduced protocols: several runs in parallel processes, JSON out
    evidence.plots      figures and tables from the JSON results
    evidence.calibration, evidence.checkpoint   what ``train`` uses: variance calibration
                        checks of a trained model, pause and resume

Results are written under ``benchmarks/results/`` by default.
"""
