"""The OpenAI-compatible routes under `/{tenant_id}/deployments/v2/llms/{deployment_name}/v1`."""
