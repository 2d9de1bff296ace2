"""Heads read from files for registration: the labels of a bot (a list or a labels file), the
two tensors of a TF checkpoint, and the classifier layer of a slim Inception-V4 checkpoint with
the check that its trunk is the serving trunk. Each refuses (InvalidHead, TrunkMismatch) before
anything is registered."""
from __future__ import annotations

import os

import numpy as np

from heads import files
from heads.errors import InvalidHead, TrunkMismatch
from heads.head import validate_head_arrays, validate_labels

Arrays = tuple[np.ndarray, np.ndarray, tuple[str, ...]]


def labels_arg(labels) -> tuple[str, ...]:
    """Labels given as a sequence, or as the path of a labels file (str or PathLike)."""
    if isinstance(labels, (str, os.PathLike)):
        return files.read_labels(labels)
    return validate_labels(labels)


def checkpoint_head(prefix: str | os.PathLike, labels, *, weights_name: str,
                    biases_name: str) -> Arrays:
    """(weights, biases, labels) of the head held by the TF checkpoint `prefix`."""
    labels_t = labels_arg(labels)
    w, b = files.read_checkpoint_tensors(prefix, [weights_name, biases_name])
    try:
        validate_head_arrays(w, b, labels_t)
    except InvalidHead as exc:
        raise InvalidHead(f"checkpoint '{os.fspath(prefix)}': {exc}") from None
    return w, b, labels_t


def slim_head(bot_id: str, prefix: str | os.PathLike, labels, *,
              serving_trunk_prefix: str | os.PathLike | None,
              force: bool) -> tuple[np.ndarray, np.ndarray, tuple[str, ...], str]:
    """(weights, biases, labels, source) of the classifier layer of a slim checkpoint; with
    `serving_trunk_prefix`, only if its trunk is the serving trunk or `force` (then the source
    says so). Raises TrunkMismatch, HeadLoadError, InvalidHead."""
    labels_t = labels_arg(labels)
    prefix = os.fspath(prefix)
    w, b = files.read_checkpoint_tensors(prefix, [files.SLIM_WEIGHTS_KEY,
                                                  files.SLIM_BIASES_KEY])
    try:
        validate_head_arrays(w, b, labels_t)  # cheap refusals before hashing two trunks
    except InvalidHead as exc:
        raise InvalidHead(f"slim checkpoint '{prefix}': {exc}") from None
    source = f"slim:{os.path.abspath(prefix)}"
    if serving_trunk_prefix is not None:
        from backbone import trunk_digest

        theirs = trunk_digest(prefix)
        ours = trunk_digest(os.fspath(serving_trunk_prefix))
        if theirs != ours:
            if not force:
                raise TrunkMismatch(
                    f"the trunk of '{prefix}' differs from the serving trunk "
                    f"'{os.fspath(serving_trunk_prefix)}' (digest {theirs[:12]} vs "
                    f"{ours[:12]}): that model's trunk was fine-tuned too, so bot "
                    f"'{bot_id}' would give different predictions from the original model; "
                    "use --force (force=True) to import its classifier layer anyway"
                )
            source += f" (forced: trunk {theirs[:12]} differs from the serving trunk)"
    return w, b, labels_t, source
