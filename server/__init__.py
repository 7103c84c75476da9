"""The HTTP service: protocol models (`protocol`), parameters to the engine (`params`), the asyncio
bridge (`bridge`, `streaming`), routes (`routes/`), tenants, tokens and deployments (`tenancy`,
`deployments`, `auth`, `db`), metrics, the app (`app`), the client library (`client`) and the
command line (`__main__`, the service's only reader of environment variables)."""
