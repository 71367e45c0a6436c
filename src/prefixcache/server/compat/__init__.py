"""What routers and other servers' clients expect: vLLM's token and render routes, engine-info
probes, load reports and block-hash answers for KV events."""
