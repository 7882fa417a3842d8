"""posttrain: post-train LLMs with JAX on Kubernetes."""
