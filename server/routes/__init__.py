"""HTTP routes: inference (`inference.py`), service-wide endpoints (`service.py`), the control plane
(`control.py`), the adapter registry (`registry.py`), the OpenAPI document (`openapi.py`) and its
offline docs pages (`docs.py`)."""
