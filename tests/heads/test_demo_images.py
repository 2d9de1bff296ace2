"""The generated labelled images (`heads.demo_images`) the demo and the benchmark train bots on:
a pure function of (kind, label, index, seed), one folder per label, and a seed that gives
other pictures (the benchmark's gate images are never the demo's)."""
from __future__ import annotations

import io

from heads.demo_images import KINDS, demo_image, write_demo_images


def _png(kind, label, index, seed):
    buffer = io.BytesIO()
    demo_image(kind, label, index, seed).save(buffer, "PNG")
    return buffer.getvalue()


def test_demo_images_are_deterministic():
    assert _png("scenes", "snow", 3, 0) == _png("scenes", "snow", 3, 0)
    assert _png("scenes", "snow", 3, 0) != _png("scenes", "snow", 4, 0)
    assert _png("scenes", "snow", 3, 0) != _png("scenes", "snow", 3, 1)


def test_a_kind_is_written_as_one_folder_per_label_and_only_missing_files(tmp_path):
    folder = write_demo_images(tmp_path, "light", 2, seed=4)
    assert folder == tmp_path / "light"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png")) == [
        f"{label}/{i:03d}.png" for label in sorted(KINDS["light"]) for i in range(2)]
    first = folder / "dark" / "000.png"
    first.write_bytes(b"kept")
    write_demo_images(tmp_path, "light", 2, seed=4)
    assert first.read_bytes() == b"kept"
    assert (folder / "dim" / "001.png").read_bytes() == _png("light", "dim", 1, 4)
