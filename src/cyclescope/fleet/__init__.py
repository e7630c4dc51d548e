"""A fleet: many hosts' databases shipped into one (ship.py from each host, place.py at the central
side, over a shared path or `serve --ingest`), analysed on the embedded engine or on Dask
(engine.py), kept within a size budget by merging old epochs (retain.py)."""
