"""Files other processes read while they are written (``vllm_recycling.files``): the one atomic
safetensors write of priors and snapshots, the cleanup of what a killed write leaves, and the one
advisory lock of prior computations and model preparations."""

from __future__ import annotations

import pytest
import torch

from vllm_recycling import files


def test_atomic_save_leaves_only_the_file_with_the_mode_asked_for(tmp_path):
    from safetensors import safe_open

    tensors = {"t": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    shared, private = tmp_path / "a" / "shared.safetensors", tmp_path / "a" / "private.safetensors"
    files.atomic_save_safetensors(shared, tensors, {"k": "v"}, readable=True)
    files.atomic_save_safetensors(private, tensors, {"k": "v"})
    assert sorted(p.name for p in shared.parent.iterdir()) == ["private.safetensors", "shared.safetensors"]
    assert oct(shared.stat().st_mode & 0o777) == "0o644" and oct(private.stat().st_mode & 0o777) == "0o600"
    with safe_open(str(shared), framework="pt") as f:
        assert f.metadata() == {"k": "v"} and torch.equal(f.get_tensor("t"), tensors["t"])


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "p.safetensors"
    files.atomic_save_safetensors(path, {"t": torch.zeros(2)}, {})
    before = path.read_bytes()
    monkeypatch.setattr(files.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        files.atomic_save_safetensors(path, {"t": torch.ones(2)}, {})
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]


def test_stale_temporaries_of_one_target_only(tmp_path):
    path = tmp_path / "p.safetensors"
    mine = [tmp_path / ".p.safetensors.abc.tmp", tmp_path / ".p.safetensors.def.tmp"]
    others = [tmp_path / ".q.safetensors.abc.tmp", tmp_path / "p.safetensors", tmp_path / ".p.safetensors.lock"]
    for p in mine + others:
        p.write_bytes(b"x")
    assert sorted(files.remove_stale_temporaries(path)) == sorted(mine)
    assert all(p.exists() for p in others) and not any(p.exists() for p in mine)


def test_a_lock_waiting_with_a_callback_calls_it_until_the_lock_is_free(tmp_path, monkeypatch):
    """``flock`` locks of two opens of one file exclude each other, in one process too: the
    second lock calls ``waiting`` between its tries, and what ``waiting`` raises ends the wait
    without the lock."""
    pytest.importorskip("fcntl")
    monkeypatch.setattr(files, "LOCK_POLL_S", 0.0)
    path = tmp_path / "sub" / "x.lock"
    calls = []

    def waiting():
        calls.append(1)
        if len(calls) == 3:
            raise SystemExit(3)

    with files.FileLock(path) as first:
        assert first.held and path.exists()
        second = files.FileLock(path, waiting=waiting)
        with pytest.raises(SystemExit):
            second.__enter__()
        assert len(calls) == 3 and not second.held and second.file is None
    assert not first.held
    with files.FileLock(path, waiting=lambda: pytest.fail("the lock is free")) as again:
        assert again.held
