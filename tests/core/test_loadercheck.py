"""forge.llm.loadercheck without a trtllm-check directory: how a checker directory that cannot be used is refused."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("where", ["cache", "unwritable"])
def test_a_checker_source_that_cannot_be_unpacked_is_one_line(tmp_path, where):
    """Bad input: a trtllm-check directory whose source tarball is corrupt, or a cache it cannot be unpacked into."""
    from forge.errors import UsageError
    from forge.llm import loadercheck

    root = tmp_path / "checker"
    root.mkdir()
    (root / "check_ckpt.py").write_text("")
    (root / "trtllm-src-0.17.0.tar.gz").write_bytes(b"not a tarball")
    cache = tmp_path / "cache" if where == "cache" else Path("/proc/forge-no-such-dir")
    with pytest.raises(UsageError) as caught:
        loadercheck.at(root, cache)
    line = caught.value.one_line()
    assert line.startswith(f"cannot unpack {root / 'trtllm-src-0.17.0.tar.gz'}: ") and "\n" not in line, line
    if where == "cache":
        assert not list((tmp_path / "cache").glob(".extract-*"))  # the half-unpacked copy is removed
