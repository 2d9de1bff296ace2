"""A refused head upload never names the server's temporary files (test_codecs_admin.py covers
the accepted upload)."""
from __future__ import annotations

from pathlib import Path

import pytest

from heads import InvalidHead
from service.codecs.admin import HeadUpload, register_upload

UPLOAD = HeadUpload(b"IDX", {".data-00000-of-00001": b"D0"}, b"cat\n", {})


class RefusingStore:
    """`register_checkpoint` refuses with `make_error(prefix, labels_path)`; remembers where the
    upload was written."""

    def __init__(self, make_error) -> None:
        self.make_error = make_error
        self.prefix: Path | None = None

    def register_checkpoint(self, bot_id, prefix, labels_path, **kwargs) -> int:
        self.prefix = Path(prefix)
        raise self.make_error(Path(prefix), Path(labels_path))


def test_the_upload_is_written_to_a_temporary_directory_named_for_it():
    store = RefusingStore(lambda prefix, labels: InvalidHead("no"))
    with pytest.raises(InvalidHead):
        register_upload(store, "acme", UPLOAD)
    assert store.prefix.parent.name.startswith("multihead-upload-")
    assert not store.prefix.parent.exists()  # removed after the refusal


def test_a_refusal_names_the_uploaded_parts_instead_of_server_paths():
    def error(prefix: Path, labels: Path) -> InvalidHead:
        return InvalidHead(f"cannot read '{labels}' (bad UTF-8); {prefix}.index is truncated; "
                           f"nothing kept in {prefix.parent}")

    with pytest.raises(InvalidHead) as info:  # the same class: the same status and code
        register_upload(RefusingStore(error), "acme", UPLOAD)
    assert info.value.args == (
        "cannot read <labels part> (bad UTF-8); <uploaded checkpoint>.index is truncated; "
        "nothing kept in <upload>",)


def test_a_refusal_without_a_path_is_raised_unchanged():
    original = InvalidHead("labels", "as the store said it")  # two args: kept as they are
    with pytest.raises(InvalidHead) as info:
        register_upload(RefusingStore(lambda prefix, labels: original), "acme", UPLOAD)
    assert info.value is original and original.args == ("labels", "as the store said it")
