"""Where a job's models come from: a local directory, a gs:// prefix (copied to this
run's scratch directory, its weights read in place) or an hf://org/name[@rev] repository
(fetched into the Hugging Face cache), for spec.model, the distillation teacher and
spec.lora.restoreFrom."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx

from posttrain.trainer import models, storage

HF_CACHE = Path.home() / ".cache" / "posttrain" / "models"
# What the trainer reads of an hf:// repository: safetensors weights (or a PEFT adapter),
# configs and tokenizer files; not the PyTorch, GGUF or ONNX copies many repositories hold.
HF_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


def local_model_dir(
    source: str, scratch: Path, *, weights: bool = True, field: str = "spec.model.source"
) -> str:
    """A local directory holding a model or adapter: the path itself, a copy of a gs://
    prefix under this run's `scratch` (without its ``*.safetensors`` files unless
    `weights`: the loader reads its blocks of those from gs:// directly), or an hf://
    repository in the Hugging Face cache. `field` names the source in errors."""
    if storage.is_gcs(source):
        target = scratch / "sources" / source.removeprefix("gs://").replace("/", "_")
        storage.download_dir(source, target, skip=() if weights else (".safetensors",))
        return str(target)
    if source.startswith("hf://"):
        return _hub_snapshot(source, field)
    if not Path(source).is_dir():
        raise FileNotFoundError(f"{field}: {source} is not a directory")
    return source


def _hub_snapshot(source: str, field: str) -> str:
    """The files the trainer reads of an hf://org/name[@rev] repository, fetched into the
    Hugging Face cache. A wrong name is the job's error (ValueError naming `field`); a Hub
    that does not answer is storage.Unreachable (the pod retries)."""
    try:
        from huggingface_hub import errors, snapshot_download
    except ImportError as e:
        raise ValueError(f"{field}: hf:// needs the huggingface_hub package") from e
    repo, _, revision = source.removeprefix("hf://").partition("@")
    try:
        return snapshot_download(
            repo, revision=revision or None, cache_dir=str(HF_CACHE), allow_patterns=HF_FILES
        )
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as e:
        reason = (
            "no such repository"
            if isinstance(e, errors.RepositoryNotFoundError)
            else (f"no revision {revision!r}")
        )
        raise ValueError(f"{field}: {source}: {reason} on the Hugging Face Hub") from None
    except errors.GatedRepoError:
        raise ValueError(
            f"{field}: {source} is gated: accept its terms on the Hub and give the job a "
            "token (spec.hfTokenSecret)"
        ) from None
    except Exception as e:  # noqa: BLE001 - network and Hub failures come in many types
        reason = storage.root_cause(e)
        raise storage.Unreachable(
            f"{field}: cannot fetch {source} from the Hugging Face Hub ({reason}); "
            "check the network or copy the model to a path or gs:// and point the field there"
        ) from None


def load_model_source(
    source: str, scratch: Path, *, field: str = "spec.model.source", **kwargs: Any
) -> tuple[nnx.Module, Any]:
    """models.load_model of a spec's model source (a path, gs:// or hf://); on gs:// each
    host fetches only the blocks of the weights its devices hold."""
    model_dir = local_model_dir(source, scratch, weights=False, field=field)
    return models.load_model(model_dir, weights=weights_uri(source), **kwargs)


def weights_uri(source: str) -> str | None:
    """Where load_model reads the weights of `source` when not from its local copy."""
    return source if storage.is_gcs(source) else None
