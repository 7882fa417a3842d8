"""The local control plane of scripts/control_plane.py, one module a concern:
settings, build, pki, processes, webhooks, nodes, components, lifecycle."""
