"""Serve a trained searcher as a tool: an HTTP API (`searcher_server`) and an MCP server (`mcp_server`).

Both front ends share `service.SearcherService` (validation, batched rollouts, served context,
answers). Build one with `loading.build_service(ServiceSpec(checkpoint=... | model=..., loop=..., index=... |
retriever_url=..., generator=...))`. Submodules are imported on use so `sleuth --help` stays fast.
"""
