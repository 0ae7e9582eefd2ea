"""anchor-rm: Representation Anchoring (ANCHOR) for weak-to-strong reward models.

The library's folders are its layers, each importing only those below it (tests/test_architecture.py checks):
data (1) -> model (2) -> evaluation (3) -> method (4) -> mlflow_edge (5) -> pipeline (6) -> cli (7).
client.py (the service's client) stands beside them and imports the model layer only. The Ray edge (tuning/) and
the BentoML service (service/) sit outside the package, on top. docs/architecture.md draws it.
"""
