"""Core of the NeFL edge kit: nested submodels, NeFedAvg, local training, data.

The apps (aggregator/, edge_client/, export/) import this package; it imports none of them.
"""

__version__ = "0.1.0"
