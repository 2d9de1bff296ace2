"""What the built-in runners' loads import, decided before loading (`registry.load_imports`).

A start imports these packages beforehand, beside its other work, and only these: TensorFlow
takes 3-5 s of a 2-core machine to import, and a trunk whose compiled model is in the cache (or
an INT8 trunk, an OpenVINO IR) loads without it.

NOTE: kept out of `backbone.runners.tf` and `backbone.runners.openvino` on purpose: their
source keys the compiled-model cache and the INT8 trunks (`CompiledCache`,
`backbone.quantize.source_digest`), which a start-up concern must not invalidate.
"""
from __future__ import annotations

from backbone.runners import openvino, registry, tf
from backbone.runners.base import LoadRequest


def tf_imports(request: LoadRequest) -> tuple[str, ...]:
    return ("tensorflow",)


def openvino_imports(request: LoadRequest) -> tuple[str, ...]:
    """OpenVINO; TensorFlow too unless the load needs none: an INT8 trunk, or a compiled model
    in the cache (whose key names OpenVINO's version: this imports OpenVINO)."""
    if request.precision == "int8":
        return ("openvino",)
    if request.cache_dir:
        cache = openvino.CompiledCache(request.cache_dir, prefix=request.prefix,
                                       precision=request.precision,
                                       with_logits=request.with_logits)
        if cache.path.exists() and cache.meta_path.exists():
            return ("openvino",)
    return ("tensorflow", "openvino")


registry.declare_load_imports(tf.SPEC.name, tf_imports)
registry.declare_load_imports(openvino.SPEC.name, openvino_imports)
