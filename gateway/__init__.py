"""colibri-gateway: an opt-in HTTP process in front of colibrid (OpenAI-compatible API,
Prometheus metrics, the live expert map), a client of the user socket like colictl."""
