"""The service on Ray Serve: an ingress serving the whole HTTP API and N engine replicas, adapter
requests routed to the replicas that hold their adapter (Serve's model multiplexing), registry and
tenants shared through the database and blob store (docs/architecture.md, "The cluster")."""
