"""Pure functions that turn a PostTrainJob into the Kubernetes objects that run it."""

from posttrain.render.jobset import RenderConfig
from posttrain.render.objects import render

__all__ = ["RenderConfig", "render"]
