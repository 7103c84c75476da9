"""HTTP routes: inference (`inference.py`) and service-wide endpoints (`service.py`)."""
