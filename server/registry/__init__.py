"""The `pbase` adapter registry: repos per tenant, numbered versions and checkpoints, blobs, the
three-step upload (service.AdapterRegistry, uploads.UploadService) and the `pbase` source
(source.PbaseResolver). HTTP routes are a thin layer over these service objects."""
